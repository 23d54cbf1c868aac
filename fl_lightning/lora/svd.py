"""FlexLoRA (Bai, Chen, Qian, Yao, Li, NeurIPS 2024): SVD of the aggregated update; docs/algorithms.md (28.4)."""

from __future__ import annotations

import torch

from .base import LayerUpdate, LoRAAggregation, mean_product


class SVD(LoRAAggregation):
    """ΔW = sum_i w_i B_i A_i = U S V^T; the global adapter is its best rank-r approximation,
    B = U_r S_r^{1/2}, A = S_r^{1/2} V_r^T (28.4), and a client of rank r_i trains the first r_i
    components (the best rank-r_i approximation, Eckart-Young). Exact when rank(ΔW) <= r."""

    name = "svd"

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        delta = mean_product(a, b, w)
        u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
        root = s[: ctx.rank].sqrt()
        return LayerUpdate(a=(root[:, None] * vh[: ctx.rank]).to(delta.dtype), b=(u[:, : ctx.rank] * root).to(delta.dtype))
