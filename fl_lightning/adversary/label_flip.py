"""Label flipping (docs/algorithms.md, (26.2.1)): every label y of a malicious client becomes pi(y)."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.adversary.base import DataPoisoning


class LabelFlip(DataPoisoning):
    """pi(y) = C - 1 - y (``mapping`` null), or the stated map ``{y: pi(y)}`` (labels not named stay).

    Args:
        mapping: source class -> flipped class; null: y -> C - 1 - y.
    """

    def __init__(self, mapping: dict[int, int] | None = None) -> None:
        self.mapping = None if mapping is None else {int(k): int(v) for k, v in mapping.items()}

    def check(self, num_classes: int) -> None:
        if self.mapping is not None:
            bad = [c for pair in self.mapping.items() for c in pair if not 0 <= c < num_classes]
            if bad:
                raise ValueError(f"attack.data LabelFlip.mapping classes must be in [0, {num_classes}), got {bad[0]}")

    def table(self, num_classes: int, device: torch.device) -> Tensor:
        """pi as a lookup table ``[C]``."""
        table = torch.arange(num_classes - 1, -1, -1) if self.mapping is None else torch.arange(num_classes)
        for source, flipped in (self.mapping or {}).items():
            table[source] = flipped
        return table.to(device)

    def poison(self, inputs: Tensor, labels: Tensor, num_classes: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return inputs, self.table(num_classes, labels.device)[labels]
