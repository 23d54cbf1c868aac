"""FedSA-LoRA (Guo, Zeng, Wang, Fan, Wang, Qu, ICLR 2025): A shared, B personal; docs/algorithms.md (28.8)."""

from __future__ import annotations

from .base import LayerUpdate, LoRAAggregation


class ShareA(LoRAAggregation):
    """A <- sum_i w_i A_i (the algorithm's step), each B_i stays with its client as a personal tensor
    (``personal`` globs, FedAvgP). Client i's model adds B_i A: what it predicts with is exact, not averaged."""

    name = "share_a"
    needs_clients = False
    private = True
    personal_b = True

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        return LayerUpdate()
