"""The secure aggregation protocol, simulated message by message (docs/algorithms.md, (31.3)-(31.5); Bonawitz et al.,
CCS 2017, with SecAgg+'s sparse graph, Bell et al., CCS 2020).

Each client i of the round holds a key pair (sk_i, pk_i = g^sk_i mod p) and a self-mask seed b_i (from its round
seed). Key agreement is Diffie-Hellman in F_p: s_ij = pk_j^sk_i = g^(sk_i sk_j) = s_ji (simulated: the field is
far too small to be secure, the arithmetic is the protocol's). Each client Shamir-shares sk_i and b_i among its
neighbours with threshold t and sends

    z_i = y_i + PRG(b_i) + sum_{j in N(i), j > i} PRG(s_ij) - sum_{j in N(i), j < i} PRG(s_ij)   (mod M)   (31.3)

The server sums the z_i that arrive (set U); pairwise masks between two arrivals cancel. From the shares the
surviving neighbours return it reconstructs b_i for each i in U and sk_j for each client j that dropped, and
removes PRG(b_i) and the dropped clients' pairwise masks (31.5): what is left is sum_{i in U} y_i mod M, and the
server saw nothing else of any y_i.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fl_lightning.secagg.shamir import PRIME, reconstruct, share

GENERATOR = 3
"""The base g of the simulated Diffie-Hellman key agreement in F_p."""
ELEMENT_BYTES = 8
"""The bytes of one field element on the wire (a public key, a share): 61 bits, in 8 bytes."""


def prg(seed: int, size: int, modulus: int) -> Tensor:
    """The mask expanded from a seed: ``size`` integers uniform in [0, modulus) (int64)."""
    return torch.randint(0, modulus, (size,), generator=torch.Generator().manual_seed(seed % (1 << 63)), dtype=torch.int64)


def agree(secret_key: int, public_key: int) -> int:
    """s_ij = pk_j^sk_i mod p: the pair's shared seed."""
    return pow(public_key, secret_key, PRIME)


@dataclass
class Party:
    """One client's secrets and the shares it dealt (holder -> share)."""

    secret_key: int
    public_key: int
    self_seed: int
    key_shares: dict[int, int] = field(default_factory=dict)
    seed_shares: dict[int, int] = field(default_factory=dict)


def setup(seeds: list[int], graph: list[set[int]], threshold: list[int]) -> list[Party]:
    """Advertise keys and share keys (the protocol's rounds 0 and 1): each client's secrets from its round seed,
    sk_i and b_i shared among its neighbours with threshold t_i."""
    parties = []
    for i, seed in enumerate(seeds):
        rng = random.Random(seed)
        secret_key, self_seed = rng.randrange(1, PRIME - 1), rng.randrange(PRIME)
        party = Party(secret_key, pow(GENERATOR, secret_key, PRIME), self_seed)
        holders = sorted(graph[i])
        party.key_shares = share(secret_key, holders, threshold[i], rng)
        party.seed_shares = share(self_seed, holders, threshold[i], rng)
        parties.append(party)
    return parties


def pair_mask(i: int, j: int, parties: list[Party], size: int, modulus: int) -> Tensor:
    """Client i's share of the pair's mask: +PRG(s_ij) for j > i, -PRG(s_ij) for j < i (mod M)."""
    mask = prg(agree(parties[i].secret_key, parties[j].public_key), size, modulus)
    return mask if j > i else (modulus - mask) % modulus


def masked_input(i: int, y: Tensor, parties: list[Party], graph: list[set[int]], modulus: int) -> Tensor:
    """z_i of (31.3): the client's vector y_i in [0, M) under its self mask and its pairwise masks."""
    z = (y + prg(parties[i].self_seed, y.numel(), modulus)) % modulus
    for j in sorted(graph[i]):
        z = (z + pair_mask(i, j, parties, y.numel(), modulus)) % modulus
    return z


def unmask(masked: dict[int, Tensor], parties: list[Party], graph: list[set[int]], threshold: list[int], modulus: int) -> Tensor:
    """The server's unmasking (31.5): sum of the arrived z_i minus the reconstructed self masks of the arrivals and
    the pairwise masks the arrivals hold with each dropped client, whose key is reconstructed from its surviving
    neighbours' shares. ``TooFewShares`` (one line) when a secret has fewer than t surviving holders."""
    arrived = set(masked)
    size = next(iter(masked.values())).numel()
    total = torch.zeros(size, dtype=torch.int64)
    for z in masked.values():
        total = (total + z) % modulus
    for i in sorted(arrived):
        shares = {j: parties[i].seed_shares[j] for j in graph[i] & arrived}
        self_seed = reconstruct(shares, threshold[i], f"client {i}'s self-mask seed")
        total = (total - prg(self_seed, size, modulus)) % modulus
    for d in sorted(set(range(len(parties))) - arrived):
        shares = {j: parties[d].key_shares[j] for j in graph[d] & arrived}
        if not graph[d] & arrived:
            continue  # no arrival holds a mask with it
        secret_key = reconstruct(shares, threshold[d], f"dropped client {d}'s key")
        for j in sorted(graph[d] & arrived):
            seed = agree(secret_key, parties[j].public_key)  # s_dj, computed by the server from pk_j
            mask = prg(seed, size, modulus)
            held = mask if d > j else (modulus - mask) % modulus  # what j added for the pair (j, d)
            total = (total - held) % modulus
    return total


def protocol_bytes(size: int, bits: int, degree: int, returned_shares: int) -> int:
    """One arriving client's uplink in bytes: its public key, 2 shares per neighbour, the masked vector of ``size``
    values of ``bits`` bits, and the shares it returns in unmasking."""
    return ELEMENT_BYTES * (1 + 2 * degree + returned_shares) + -(-size * bits // 8)
