"""Fixed-point encoding of the clients' vectors for a modular sum (docs/algorithms.md, (31.1), (31.2), (31.6)):
flattening, clipping, stochastic rounding, the randomized Hadamard rotation and conditional randomized rounding of
distributed DP, and the scale that keeps the sum from wrapping modulo M = 2^bits."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.core import flat
from fl_lightning.core.tasks import Payload


def flatten(upload: Payload) -> Tensor:
    """Every tensor of every entry, in the upload's order, as one float64 vector on the CPU (the protocol's integers)."""
    return flat.flatten(upload).cpu()


def clip_rows(vectors: Tensor, clip: float) -> Tensor:
    """Each row times min(1, C / ||row||) (31.1)."""
    norms = torch.linalg.vector_norm(vectors, dim=1, keepdim=True)
    return vectors * torch.clamp(clip / (norms + 1e-300), max=1.0)


def stochastic_round(values: Tensor, generator: torch.Generator) -> Tensor:
    """floor(v) + Bernoulli(v - floor(v)): unbiased, within 1 of v (int64)."""
    low = torch.floor(values)
    up = torch.rand(values.shape, generator=generator, dtype=torch.float64) < (values - low)
    return low.to(torch.int64) + up.to(torch.int64)


def plain_scale(bits: int, clients: int, clip: float) -> float:
    """The largest s at which n stochastically rounded vectors of coordinates within C sum inside [-M/2, M/2):
    n (s C + 1) <= M/2 - 1 (31.2)."""
    return ((2 ** (bits - 1) - 1) / clients - 1) / clip


def to_signed(values: Tensor, modulus: int) -> Tensor:
    """The representative in [-M/2, M/2) of each residue modulo M."""
    values = values % modulus
    return torch.where(values >= modulus // 2, values - modulus, values)


def padded(size: int) -> int:
    """The power of two the rotation works in (the vector zero-padded to it)."""
    return 1 << max(0, (size - 1).bit_length())


def hadamard(rows: Tensor) -> Tensor:
    """H rows / sqrt(d) along the last dimension (a power of two): the normalised Walsh-Hadamard transform, its own
    inverse."""
    d = rows.shape[-1]
    out, h = rows.clone(), 1
    while h < d:
        out = out.reshape(*rows.shape[:-1], d // (2 * h), 2, h)
        out = torch.stack([out[..., 0, :] + out[..., 1, :], out[..., 0, :] - out[..., 1, :]], dim=-2)
        h *= 2
    return out.reshape(rows.shape) / math.sqrt(d)


def rotate(rows: Tensor, signs: Tensor) -> Tensor:
    """The randomized Hadamard rotation H D x / sqrt(d) of each row, zero-padded to len(signs) (31.6)."""
    padded_rows = torch.nn.functional.pad(rows, (0, signs.numel() - rows.shape[-1]))
    return hadamard(padded_rows * signs)


def unrotate(vector: Tensor, signs: Tensor, size: int) -> Tensor:
    """The inverse rotation D H v / sqrt(d), cut back to ``size``."""
    return (hadamard(vector) * signs)[..., :size]


def rounded_norm_bound(clip: float, size: int, beta: float) -> float:
    """Delta_2 of conditional randomized rounding, in rounded units (Kairouz, Liu, Steinke 2021; (31.7)): a vector of
    norm <= c rounds to norm <= min(sqrt(c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2)), c + sqrt(d)) with
    probability >= 1 - beta; rounding is repeated until it does."""
    squared = clip**2 + size / 4 + math.sqrt(2 * math.log(1 / beta)) * (clip + math.sqrt(size) / 2)
    return min(math.sqrt(squared), clip + math.sqrt(size))


def conditional_round(values: Tensor, bound: float, generator: torch.Generator, tries: int = 1000) -> tuple[Tensor, int]:
    """Stochastic rounding of ``values`` repeated until the rounded vector's norm is <= ``bound`` (31.7); also how
    many draws it took."""
    for attempt in range(1, tries + 1):
        rounded = stochastic_round(values, generator)
        if float(torch.linalg.vector_norm(rounded.double())) <= bound:
            return rounded, attempt
    raise RuntimeError(f"conditional rounding: no rounding within the norm bound {bound:g} in {tries} draws")


def granularity(bits: int, clients: int, clip: float, size: int, noise_std: float, k_stddevs: float) -> float:
    """gamma, the value of one integer step under distributed DP (31.8): the modular range M covers k standard
    deviations of a summed coordinate, (M gamma / 2)^2 = k^2 (n c^2 / d + n gamma^2 / 4 + sigma^2), sigma the std
    of the summed noise (real units)."""
    half = 2.0 ** (bits - 1)
    room = half**2 - k_stddevs**2 * clients / 4
    if room <= 0:
        raise ValueError(f"secure_aggregation.bits={bits} leaves no room for {clients} clients' rounding at k_stddevs={k_stddevs:g}; raise bits")
    return k_stddevs * math.sqrt(clients * clip**2 / size + noise_std**2) / math.sqrt(room)
