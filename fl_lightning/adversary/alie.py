"""A little is enough (Baruch, Baruch and Goldberg, NeurIPS 2019; docs/algorithms.md, (26.2.6)): every
malicious client sends mu - z_max sigma, the benign uploads' coordinate-wise mean and standard deviation."""

from __future__ import annotations

import math
from statistics import NormalDist

from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack


def z_max(n: int, f: int) -> float:
    """s = floor(n/2 + 1) - f, z_max = Phi^-1((n - f - s) / (n - f))."""
    s = math.floor(n / 2 + 1) - f
    return NormalDist().inv_cdf((n - f - s) / (n - f))


class ALIE(UploadAttack):
    """u_m -> mu - z sigma (sigma: the unbiased standard deviation over the benign uploads).

    Args:
        z: a fixed z; null: z_max(n, f) of the round.
    """

    needs_benign = True

    def __init__(self, z: float | None = None) -> None:
        self.z = z

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        z = self.z if self.z is not None else z_max(view.reporting, view.malicious)
        crafted = benign.mean(0) - z * benign.std(0)
        return crafted.expand_as(own).clone()
