"""Coordinate-wise trimmed mean (Yin et al., ICML 2018), docs/algorithms.md (26.1.3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule


class TrimmedMean(RobustRule):
    """Per coordinate, drop the b largest and b smallest values and average the n - 2b left (unweighted).

    b = floor(beta * n) when ``beta`` is given, else b = f. Needs n > 2b (2 beta < 1).
    """

    name = "trimmed_mean"
    needs_majority = True

    def __init__(self, beta: float | None = None) -> None:
        if beta is not None and not 0 <= beta < 0.5:
            raise ValueError(f"robust.beta must be in [0, 0.5) (2 beta < 1), got {beta}")
        self.beta = beta

    def trimmed(self, n: int, f: int) -> int:
        return math.floor(self.beta * n) if self.beta is not None else f

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        n, b = V.shape[0], self.trimmed(V.shape[0], f)
        return Combined(torch.sort(V, dim=0).values[b : n - b].mean(dim=0))
