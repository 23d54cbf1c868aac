"""FedEx-LoRA (Singhal, Ponkshe, Vepakomma, ACL 2025): average the factors, fold the residual; docs/algorithms.md (28.3)."""

from __future__ import annotations

from .base import LayerUpdate, LoRAAggregation, mean_product, pad_a, pad_b


class ExactResidual(LoRAAggregation):
    """A <- Ā = sum_i w_i A_i, B <- B̄ = sum_i w_i B_i (zero-padded) and W0 <- W0 + s (sum_i w_i B_i A_i - B̄ Ā)
    (28.3): W0 + s B̄ Ā is then W0 + s sum_i w_i B_i A_i exactly, at any ranks."""

    name = "exact_residual"
    folds = True

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        a_mean = sum(float(wi) * pad_a(ai, ctx.rank) for ai, wi in zip(a, w))
        b_mean = sum(float(wi) * pad_b(bi, ctx.rank) for bi, wi in zip(b, w))
        return LayerUpdate(a=a_mean, b=b_mean, fold=mean_product(a, b, w) - b_mean @ a_mean)
