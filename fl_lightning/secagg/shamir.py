"""Shamir secret sharing over the prime field F_p, p = 2^61 - 1 (docs/algorithms.md, (31.4)): a secret s is the
constant term of a random polynomial f of degree t - 1; share j is (j, f(j)); any t shares give s back by
Lagrange interpolation at 0, fewer say nothing about it."""

from __future__ import annotations

import random
from collections.abc import Sequence

PRIME = (1 << 61) - 1
"""The field's modulus, a Mersenne prime: secrets, shares and the simulated keys are elements of F_p."""


class TooFewShares(ValueError):
    """Fewer than the threshold's shares of a secret survived: it cannot be reconstructed."""


def share(secret: int, holders: Sequence[int], threshold: int, rng: random.Random) -> dict[int, int]:
    """Shares of ``secret`` in F_p for each holder (a non-zero field point each: its id + 1), any ``threshold`` of
    which reconstruct it (31.4): f(z) = secret + a_1 z + ... + a_{t-1} z^{t-1}, the a_k drawn from ``rng``."""
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"secure_aggregation.threshold: {threshold} shares of {len(holders)} holders cannot be a threshold")
    coefficients = [secret % PRIME] + [rng.randrange(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for holder in holders:
        z, value = holder + 1, 0
        for a in reversed(coefficients):  # Horner's rule in F_p
            value = (value * z + a) % PRIME
        shares[holder] = value
    return shares


def reconstruct(shares: dict[int, int], threshold: int, what: str = "a secret") -> int:
    """f(0) from any ``threshold`` of the shares (holder -> f(holder + 1)) by Lagrange interpolation in F_p;
    ``TooFewShares`` (one line) below the threshold."""
    if len(shares) < threshold:
        raise TooFewShares(f"{what}: only {len(shares)} shares survive, fewer than the threshold t={threshold}: it cannot be reconstructed")
    points = [(holder + 1, value) for holder, value in sorted(shares.items())[:threshold]]
    secret = 0
    for i, (zi, yi) in enumerate(points):
        numerator = denominator = 1
        for j, (zj, _) in enumerate(points):
            if i != j:
                numerator = numerator * (-zj) % PRIME
                denominator = denominator * (zi - zj) % PRIME
        secret = (secret + yi * numerator * pow(denominator, PRIME - 2, PRIME)) % PRIME
    return secret
