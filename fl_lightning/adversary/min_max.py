"""Min-max (Shejwalkar and Houmansadr, NDSS 2021; docs/algorithms.md, (26.2.8)): mu + gamma p with the
largest gamma whose farthest distance to a benign upload is within the benign uploads' largest pairwise one."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack
from fl_lightning.adversary.gamma_search import EXACT, check_perturbation, largest_gamma, perturbation_of


class MinMax(UploadAttack):
    """u_m -> mu + gamma p, max_i ||u_m - g_i|| <= max_{i,j} ||g_i - g_j||.

    Args:
        perturbation: p: ``unit_vec``, ``sign`` or ``std`` (gamma_search.perturbation_of).
        gamma_init: the search's start (> 0).
        tau: the search's tolerance (> 0).
    """

    needs_benign = True

    def __init__(self, perturbation: str = "unit_vec", gamma_init: float = 10.0, tau: float = 1e-5) -> None:
        check_perturbation(perturbation, type(self).__name__)
        if not (gamma_init > 0 and tau > 0):
            raise ValueError(f"attack.upload {type(self).__name__}.gamma_init and tau must be > 0, got {gamma_init}, {tau}")
        self.perturbation, self.gamma_init, self.tau = perturbation, gamma_init, tau

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        mu, p = benign.mean(0), perturbation_of(benign, self.perturbation)
        threshold = torch.cdist(benign, benign, compute_mode=EXACT).max()

        def within(m: Tensor) -> bool:
            return bool(torch.cdist(m[None], benign, compute_mode=EXACT).max() <= threshold)

        gamma = largest_gamma(within, mu, p, self.gamma_init, self.tau)
        return (mu + gamma * p).expand_as(own).clone()
