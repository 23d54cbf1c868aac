"""Coordinate-wise median (Yin et al., ICML 2018), docs/algorithms.md (26.1.2)."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.robust.base import Combined, RobustRule, coordinate_median


class Median(RobustRule):
    """r_j = med_i V_ij for every coordinate j (unweighted); breaks down at f >= n / 2."""

    name = "median"
    needs_majority = True

    def combine(self, V: Tensor, w: Tensor, f: int) -> Combined:
        return Combined(coordinate_median(V))
