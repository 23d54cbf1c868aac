"""Geometric median by the smoothed Weiszfeld algorithm (RFA; Pillutla et al., IEEE TSP 2022),
docs/algorithms.md (26.1.6)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule


def row_norms(D: Tensor) -> Tensor:
    """Each row's L2 norm without overflow: a row whose plain norm overflows is scaled by its largest entry first."""
    norms = torch.linalg.vector_norm(D, dim=1)
    if bool(torch.isfinite(norms).all()):
        return norms
    scale = D.abs().amax(dim=1).clamp(min=torch.finfo(D.dtype).tiny)
    return torch.where(torch.isfinite(norms), norms, scale * torch.linalg.vector_norm(D / scale[:, None], dim=1))


class GeometricMedian(RobustRule):
    """v <- sum_i beta_i V_i / sum_i beta_i, beta_i = w_i / max(nu, ||v - V_i||), from the weighted mean, until a step
    moves v by at most ``tol`` (||v|| + nu), or ``iters`` steps. (RFA's stop on the objective's relative decrease fails
    against a far outlier: its distance dominates an objective that hardly changes while v is still far away.)
    Computed in float64 with overflow-safe distances. Breakdown point 1/2: needs f < n / 2."""

    name = "geometric_median"
    needs_majority = True

    def __init__(self, iters: int = 100, nu: float = 1e-6, tol: float = 1e-6) -> None:
        if iters < 1:
            raise ValueError(f"robust.iters must be an integer >= 1, got {iters}")
        if not nu > 0:
            raise ValueError(f"robust.nu must be > 0, got {nu}")
        if not tol >= 0:
            raise ValueError(f"robust.tol must be >= 0 (0: always run robust.iters steps), got {tol}")
        self.iters, self.nu, self.tol = iters, nu, tol

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        X, w = V.to(torch.float64), w.to(torch.float64)
        v = (w[:, None] * X).sum(dim=0) / w.sum()
        for _ in range(self.iters):
            beta = w / torch.clamp(row_norms(X - v), min=self.nu)
            v, previous = (beta[:, None] * X).sum(dim=0) / beta.sum(), v
            if self.tol and float(row_norms((v - previous)[None])[0]) <= self.tol * (float(row_norms(v[None])[0]) + self.nu):
                break
        return Combined(v.to(V.dtype))
