"""Gaussian attack (docs/algorithms.md, (26.2.5)): the malicious client sends noise N(0, sigma^2 I)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.adversary.base import RoundView, UploadAttack
from fl_lightning.core.participation import derive_seed

GAUSSIAN_STREAM = 0x6A55
"""Seed stream of the noise: ``derive_seed(client round seed, GAUSSIAN_STREAM)``."""


class GaussianUpload(UploadAttack):
    """u_m -> z, z ~ N(0, sigma^2 I), drawn (float64, on the CPU) from the client's round seed.

    Args:
        std: sigma > 0.
    """

    def __init__(self, std: float = 1.0) -> None:
        if not std > 0:
            raise ValueError(f"attack.upload GaussianUpload.std must be > 0, got {std}")
        self.std = std

    def craft(self, own: Tensor, benign: Tensor, view: RoundView) -> Tensor:
        rows = [
            torch.randn(own.shape[1], generator=torch.Generator().manual_seed(derive_seed(seed, GAUSSIAN_STREAM)), dtype=torch.float64)
            for seed in view.seeds
        ]
        return (self.std * torch.stack(rows)).to(own.device)
