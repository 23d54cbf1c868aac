"""What min-max and min-sum share (Shejwalkar and Houmansadr, NDSS 2021; docs/algorithms.md, (26.2.8)):
the perturbation p and the search for the largest gamma that keeps mu + gamma p within a threshold."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

PERTURBATIONS = ("unit_vec", "sign", "std")
EXACT = "donot_use_mm_for_euclid_dist"
"""Distances from the differences themselves (cdist's matrix-product shortcut rounds differently)."""


def check_perturbation(perturbation: str, owner: str) -> None:
    if perturbation not in PERTURBATIONS:
        raise ValueError(f"attack.upload {owner}.perturbation must be one of {list(PERTURBATIONS)}, got {perturbation!r}")


def perturbation_of(benign: Tensor, kind: str) -> Tensor:
    """p: -mu/||mu|| (inverse unit vector), -sign(mu) (inverse sign) or -sigma (inverse standard deviation)."""
    mu = benign.mean(0)
    if kind == "unit_vec":
        return -mu / torch.linalg.vector_norm(mu)
    if kind == "sign":
        return -torch.sign(mu)
    return -benign.std(0)


def largest_gamma(ok: Callable[[Tensor], bool], mu: Tensor, p: Tensor, gamma_init: float, tau: float) -> float:
    """The authors' halving search: gamma from ``gamma_init``, up by half the step where mu + gamma p is
    ``ok``, down where not, the step halved each time, until the last success is within ``tau``."""
    gamma, step, success = gamma_init, gamma_init, 0.0
    while abs(success - gamma) > tau:
        if ok(mu + gamma * p):
            success = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return success
