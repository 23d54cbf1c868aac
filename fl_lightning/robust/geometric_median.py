"""Geometric median by the smoothed Weiszfeld algorithm (RFA; Pillutla et al., IEEE TSP 2022),
docs/algorithms.md (26.1.6)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule


class GeometricMedian(RobustRule):
    """v <- sum_i beta_i V_i / sum_i beta_i, beta_i = w_i / max(nu, ||v - V_i||), ``iters`` times from the
    weighted mean. Breakdown point 1/2: needs f < n / 2."""

    name = "geometric_median"
    needs_majority = True

    def __init__(self, iters: int = 8, nu: float = 1e-6) -> None:
        if iters < 1:
            raise ValueError(f"robust.iters must be an integer >= 1, got {iters}")
        if not nu > 0:
            raise ValueError(f"robust.nu must be > 0, got {nu}")
        self.iters, self.nu = iters, nu

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        w = w.to(V.dtype)
        v = (w[:, None] * V).sum(dim=0) / w.sum()
        for _ in range(self.iters):
            beta = w / torch.clamp(torch.linalg.vector_norm(V - v, dim=1), min=self.nu)
            v = (beta[:, None] * V).sum(dim=0) / beta.sum()
        return Combined(v)
