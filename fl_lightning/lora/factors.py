"""FedIT: the factors averaged separately (Zhang et al., ICASSP 2024); docs/algorithms.md (28.1)."""

from __future__ import annotations

from .base import LayerUpdate, LoRAAggregation


class Factors(LoRAAggregation):
    """A <- sum_i w_i A_i, B <- sum_i w_i B_i by the algorithm's own server step (28.1); clients of lower
    rank send their factors zero-padded to the global rank. Exact only where the clients' A (or B) agree."""

    name = "factors"
    needs_clients = False
    private = True

    def layer(self, a, b, w, ctx) -> LayerUpdate:
        return LayerUpdate()
