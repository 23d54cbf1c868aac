"""HetLoRA (Cho, Liu, Xu, Fahrezi, Joshi, EMNLP 2024): zero-padding, sparsity-weighted; docs/algorithms.md (28.5)."""

from __future__ import annotations

import torch

from .base import LayerUpdate, LoRAAggregation, pad_a, pad_b


class ZeroPad(LoRAAggregation):
    """Each client's factors zero-padded to the global rank r and averaged with weights
    p_i = w_i ||B_i A_i||_F / sum_j w_j ||B_j A_j||_F (28.5); client i receives the first r_i
    components (truncation, (28.6)). Exact only where the clients' A (or B) agree."""

    name = "zero_pad"

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        norms = torch.stack([torch.linalg.matrix_norm(bi @ ai) for ai, bi in zip(a, b)]).to(w.dtype)
        p = w * norms
        p = p / p.sum() if float(p.sum()) > 0 else w
        return LayerUpdate(
            a=sum(float(pi) * pad_a(ai, ctx.rank) for ai, pi in zip(a, p)),
            b=sum(float(pi) * pad_b(bi, ctx.rank) for bi, pi in zip(b, p)),
        )
