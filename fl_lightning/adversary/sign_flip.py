"""Sign flipping (docs/algorithms.md, (26.2.4)): the malicious client sends -s times its trained upload."""

from __future__ import annotations

from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack


class SignFlip(UploadAttack):
    """u_m -> -s u_m.

    Args:
        scale: s > 0.
    """

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"attack.upload SignFlip.scale must be > 0, got {scale}")
        self.scale = scale

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        return -self.scale * own
