"""Privacy accounting of distributed DP's summed noise (docs/privacy.md, "Secure aggregation and distributed DP";
docs/algorithms.md, (31.11), (31.12)): one RDP curve per round at the integer orders of the client-level accountant
(``fl_lightning.pipeline.privacy_accounting.ORDERS``, where both papers state their bounds), rounds composed by adding
the curves, (epsilon, delta) by the same conversion (Balle et al. 2020, dp-accounting's ``compute_epsilon``). Each
round is accounted with the clients whose noise reached the sum: a client that dropped took its share of the noise
with it.

Add/remove-one-client adjacency on the rounded, rotated integer vector: L2 sensitivity Delta_2 (the conditional
rounding's bound) and L1 sensitivity Delta_1 = min(sqrt(d) Delta_2, Delta_2^2) (an integer vector's L1 norm is at
most its squared L2 norm). No amplification by sampling is claimed.
"""

from __future__ import annotations

import math

import numpy as np

from fl_lightning.pipeline.privacy_accounting import ORDERS


def l1_sensitivity(l2: float, size: int) -> float:
    return min(math.sqrt(size) * l2, l2**2)


def ddg_tau(sigma: float, clients: int) -> float:
    """tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1)): how far the sum of n discrete Gaussians N_Z(0, sigma^2)
    is from one discrete Gaussian N_Z(0, n sigma^2) (Kairouz, Liu, Steinke 2021)."""
    return 10 * sum(math.exp(-2 * math.pi**2 * sigma**2 * k / (k + 1)) for k in range(1, clients))


def ddg_rdp(l2: float, l1: float, sigma: float, clients: int, size: int) -> np.ndarray:
    """The RDP curve at ``ORDERS`` of the sum of ``clients`` draws of N_Z(0, sigma^2) per coordinate added to a sum of
    integer vectors of sensitivities (l2, l1) in dimension d (Kairouz, Liu, Steinke 2021, Prop. 14; (31.11)): with
    a = l2 / (sqrt(n) sigma), b = l1 / (sqrt(n) sigma),
    min(alpha a^2 / 2 + tau d,  alpha (a^2 + 2 b tau + tau^2 d) / 2,  alpha (a + sqrt(d) tau)^2 / 2)."""
    alpha = np.asarray(ORDERS, dtype=np.float64)
    if clients == 0 or sigma == 0:
        return np.full(len(ORDERS), np.inf)
    tau, a, b = ddg_tau(sigma, clients), l2 / (math.sqrt(clients) * sigma), l1 / (math.sqrt(clients) * sigma)
    terms = (alpha * a**2 / 2 + tau * size, alpha * (a**2 + 2 * b * tau + tau**2 * size) / 2, alpha * (a + math.sqrt(size) * tau) ** 2 / 2)
    return np.minimum(np.minimum(terms[0], terms[1]), terms[2])


def skellam_rdp(l2: float, l1: float, variance: float) -> np.ndarray:
    """The RDP curve at ``ORDERS`` of adding Sk(0, mu) per coordinate (mu: the summed noise's variance) to a sum of
    sensitivities (l2, l1) (Agarwal, Kairouz, Liu 2021, Thm. 3.5; (31.12)):
    alpha l2^2 / (2 mu) + min(((2 alpha - 1) l2^2 + 6 l1) / (4 mu^2), 3 l1 / (2 mu))."""
    alpha = np.asarray(ORDERS, dtype=np.float64)
    if variance == 0:
        return np.full(len(ORDERS), np.inf)
    return alpha * l2**2 / (2 * variance) + np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * variance**2), 3 * l1 / (2 * variance))


def epsilon_of(rdp: np.ndarray, delta: float) -> float:
    """(epsilon, delta) of an RDP curve at ``ORDERS`` (the client-level accountant's conversion)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not np.any(np.isfinite(rdp)):
        return math.inf
    return float(compute_epsilon(ORDERS, rdp, delta)[0])


class DistributedAccountant:
    """The RDP spent so far (the sum of the rounds' curves) and the rounds accounted."""

    def __init__(self, delta: float) -> None:
        self.delta, self.rounds = delta, 0
        self.rdp = np.zeros(len(ORDERS))

    def step(self, curve: np.ndarray) -> None:
        self.rdp, self.rounds = self.rdp + curve, self.rounds + 1

    def epsilon(self) -> float:
        return epsilon_of(self.rdp, self.delta) if self.rounds else 0.0
