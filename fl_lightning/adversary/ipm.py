"""Inner-product manipulation (Xie, Koyejo and Gupta, UAI 2020; docs/algorithms.md, (26.2.7)): every
malicious client sends -epsilon times the benign uploads' mean."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack


class IPM(UploadAttack):
    """u_m -> -epsilon mean(benign).

    Args:
        epsilon: > 0 (Xie et al.: small, e.g. 0.1, against median-like rules; large, e.g. 100, against Krum).
    """

    needs_benign = True

    def __init__(self, epsilon: float = 0.1) -> None:
        if not epsilon > 0:
            raise ValueError(f"attack.upload IPM.epsilon must be > 0, got {epsilon}")
        self.epsilon = epsilon

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        return (-self.epsilon * benign.mean(0)).expand_as(own).clone()
