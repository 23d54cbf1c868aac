"""FedEx-LoRA (Singhal, Ponkshe, Vepakomma, ACL 2025): average the factors, fold the residual; docs/algorithms.md (28.3)."""

from __future__ import annotations

from .base import LayerUpdate, LoRAAggregation, mean_product, pad_a, pad_b


class ExactResidual(LoRAAggregation):
    """The factors' means stand (the algorithm's step) and W0 <- W0 + s (sum_i w_i B_i A_i - B̄ Ā) (28.3):
    with the plain mean as server step, W0 + s B̄ Ā equals W0 + s sum_i w_i B_i A_i exactly."""

    name = "exact_residual"
    folds = True

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        a_mean = sum(float(wi) * pad_a(ai, ctx.rank) for ai, wi in zip(a, w))
        b_mean = sum(float(wi) * pad_b(bi, ctx.rank) for bi, wi in zip(b, w))
        return LayerUpdate(fold=mean_product(a, b, w) - b_mean @ a_mean)
