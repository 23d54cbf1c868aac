"""FLTrust (Cao, Fang, Liu and Gong, NDSS 2021), docs/algorithms.md (26.1.9)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule


class FLTrust(RobustRule):
    """Trust scores TS_i = ReLU(cos(V_i, g0)) against the server's own update g0 on its root dataset; every
    upload rescaled to ||g0||; r = sum_i TS_i ||g0|| V_i / ||V_i|| / sum_i TS_i (zero where no TS_i > 0).
    No assumption on f: trust comes from the root data, not from a majority."""

    name = "fltrust"
    needs_reference = True

    def combine(self, V: Tensor, w: Tensor, f: int, reference: Tensor | None = None) -> Combined:
        if reference is None:
            raise ValueError("robust.rule=fltrust needs the server's update on its root dataset")
        g0 = reference.to(V.dtype)
        g0_norm = torch.linalg.vector_norm(g0)
        norms = torch.linalg.vector_norm(V, dim=1)
        tiny = torch.finfo(V.dtype).tiny
        cos = (V @ g0) / torch.clamp(norms * g0_norm, min=tiny)
        trust = torch.relu(cos)
        total = trust.sum()
        if not float(total) > 0:
            return Combined(torch.zeros_like(g0))
        scaled = V * (g0_norm / torch.clamp(norms, min=tiny))[:, None]
        return Combined((trust[:, None] * scaled).sum(dim=0) / total)
