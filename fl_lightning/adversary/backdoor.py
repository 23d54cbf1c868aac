"""Pixel-pattern backdoor (docs/algorithms.md, (26.2.2)): a trigger patch in the image's bottom-right corner
on a share of a malicious client's samples, relabelled as the target class."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.adversary.base import DataPoisoning


class Backdoor(DataPoisoning):
    """T(x): the ``patch`` x ``patch`` bottom-right pixels of every channel set to ``value``; each step,
    ``round(fraction * B)`` samples of the batch (drawn by the step's generator) become (T(x), target).

    Images are ``[..., H, W]``; flat inputs ``[B, D]`` are read as square ``sqrt(D) x sqrt(D)`` images.

    Args:
        target: the backdoor's target class.
        fraction: the share of each batch poisoned, in (0, 1].
        patch: the trigger's side in pixels (>= 1).
        value: the trigger pixels' value (digits' pixels lie in [0, 1]: 1.0 is white).
    """

    def __init__(self, target: int = 0, fraction: float = 0.5, patch: int = 2, value: float = 1.0) -> None:
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"attack.data Backdoor.target must be a class index >= 0, got {target}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"attack.data Backdoor.fraction must be in (0, 1], got {fraction}")
        if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
            raise ValueError(f"attack.data Backdoor.patch must be an integer >= 1, got {patch}")
        self.target, self.fraction, self.patch, self.value = target, fraction, patch, float(value)

    def check(self, num_classes: int) -> None:
        if self.target >= num_classes:
            raise ValueError(f"attack.data Backdoor.target must be in [0, {num_classes}), got {self.target}")

    def stamp(self, inputs: Tensor) -> Tensor:
        """T(x) of every sample of ``inputs`` (a copy)."""
        images = inputs
        if inputs.dim() == 2:
            side = math.isqrt(inputs.shape[1])
            if side * side != inputs.shape[1]:
                raise ValueError(f"attack.data Backdoor needs image inputs [..., H, W] or square flat ones, got width {inputs.shape[1]}")
            images = inputs.reshape(inputs.shape[0], side, side)
        if min(images.shape[-2:]) < self.patch:
            raise ValueError(f"attack.data Backdoor.patch={self.patch} is larger than the images ({tuple(images.shape[-2:])})")
        out = images.clone()
        out[..., -self.patch :, -self.patch :] = self.value
        return out.reshape(inputs.shape)

    def poison(self, inputs: Tensor, labels: Tensor, num_classes: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        count = round(self.fraction * len(labels))
        chosen = torch.randperm(len(labels), generator=generator)[:count].to(labels.device)
        inputs, labels = inputs.clone(), labels.clone()
        inputs[chosen] = self.stamp(inputs[chosen])
        labels[chosen] = self.target
        return inputs, labels

    def triggered(self, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor] | None:
        keep = labels != self.target
        return self.stamp(inputs[keep]), torch.full_like(labels[keep], self.target)
