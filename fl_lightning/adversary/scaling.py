"""Model replacement (Bagdasaryan et al., AISTATS 2020; docs/algorithms.md, (26.2.3)): the malicious
upload scaled by gamma = n / eta, so that averaging it with the others replaces the global model."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack


class ModelReplacement(UploadAttack):
    """u_m -> gamma u_m, gamma = n / eta (n: the round's reporting clients, eta: the server lr), or ``gamma``.

    Args:
        gamma: a fixed boost; null: n / eta each round.
    """

    def __init__(self, gamma: float | None = None) -> None:
        if gamma is not None and not gamma > 0:
            raise ValueError(f"attack.upload ModelReplacement.gamma must be > 0 (or null: n / eta), got {gamma}")
        self.gamma = gamma

    def factor(self, view: RoundView) -> float:
        return self.gamma if self.gamma is not None else view.reporting / view.global_lr

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        return self.factor(view) * own
