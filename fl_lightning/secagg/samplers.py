"""The clients' integer noise of distributed DP (docs/algorithms.md, (31.9), (31.10)), drawn from a client's
generator: the discrete Gaussian by Canonne, Kamath and Steinke's (NeurIPS 2020) rejection sampler from the discrete
Laplace, and the Skellam distribution as a difference of two Poissons."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def discrete_laplace(t: float, size: int, generator: torch.Generator) -> Tensor:
    """P(Y = y) proportional to exp(-|y| / t): the difference of two geometric variables of ratio q = exp(-1/t),
    each floor(-t ln U) with U uniform in (0, 1]."""
    u = 1.0 - torch.rand((2, size), generator=generator, dtype=torch.float64)
    geometric = torch.floor(-t * torch.log(u)).to(torch.int64)
    return geometric[0] - geometric[1]


def discrete_gaussian(sigma: float, size: int, generator: torch.Generator) -> Tensor:
    """``size`` draws of N_Z(0, sigma^2), P(Y = y) proportional to exp(-y^2 / (2 sigma^2)) (31.9): with
    t = floor(sigma) + 1, a discrete Laplace candidate Y is kept with probability
    exp(-(|Y| - sigma^2 / t)^2 / (2 sigma^2)) (Canonne, Kamath, Steinke 2020, Alg. 3), all coordinates at once,
    the rejected ones drawn again. Exact up to the float64 uniforms of the Bernoulli draws."""
    if sigma == 0:
        return torch.zeros(size, dtype=torch.int64)
    t = math.floor(sigma) + 1
    out = torch.zeros(size, dtype=torch.int64)
    pending = torch.arange(size)
    while pending.numel():
        y = discrete_laplace(t, pending.numel(), generator)
        keep = torch.rand(pending.numel(), generator=generator, dtype=torch.float64) < torch.exp(
            -((y.abs().double() - sigma**2 / t) ** 2) / (2 * sigma**2)
        )
        out[pending[keep]] = y[keep]
        pending = pending[~keep]
    return out


def skellam(variance: float, size: int, generator: torch.Generator) -> Tensor:
    """``size`` draws of Sk(0, mu) = Poisson(mu / 2) - Poisson(mu / 2), of variance mu (31.10)."""
    if variance == 0:
        return torch.zeros(size, dtype=torch.int64)
    rates = torch.full((2, size), variance / 2, dtype=torch.float64)
    draws = torch.poisson(rates, generator=generator).to(torch.int64)
    return draws[0] - draws[1]
