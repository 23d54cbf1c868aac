"""Norm bounding (Sun et al., "Can you really backdoor federated learning?", 2019), docs/algorithms.md (26.1.8)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule
from fl_lightning.robust.centered_clipping import clip


class NormBound(RobustRule):
    """r = sum_i w_i clip_M(V_i): every upload scaled to norm at most M, then the weighted mean.
    No assumption on f (it bounds each client's influence, it does not outvote)."""

    name = "norm_bound"

    def __init__(self, max_norm: float = 1.0) -> None:
        if not max_norm > 0:
            raise ValueError(f"robust.max_norm must be > 0, got {max_norm}")
        self.max_norm = max_norm

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        w = w.to(V.dtype)
        return Combined((w[:, None] * clip(V, self.max_norm)).sum(dim=0) / w.sum())
