"""Dataclass settings of local training, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LocalTraining:
    """How each active client trains in a round.

    Args:
        lr: local learning rate eta_l, > 0.
        lr_decay: per-round factor in (0, 1]; round t uses ``lr * lr_decay**t``.
        steps: K local steps per round (exclusive with ``epochs``).
        epochs: E passes over the client's data per round (exclusive with ``steps``).
        batch_size: minibatch size >= 1; ``None`` uses the whole local set each step.
        weight_decay: L2 coefficient >= 0, added to every local gradient.
        personal_lr: step size gamma_v of personal tensors, > 0 (``None``: same as
            ``lr``); decays with ``lr_decay`` like ``lr``. Used by personalization algorithms.
    """

    lr: float = 0.1
    lr_decay: float = 1.0
    steps: int | None = 10
    epochs: int | None = None
    batch_size: int | None = 32
    weight_decay: float = 0.0
    personal_lr: float | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"local.lr must be > 0, got {self.lr}")
        if not 0 < self.lr_decay <= 1:
            raise ValueError(f"local.lr_decay must be in (0, 1], got {self.lr_decay}")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"set exactly one of local.steps and local.epochs, got steps={self.steps}, epochs={self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"local.steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"local.epochs must be >= 1, got {self.epochs}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"local.batch_size must be >= 1 (or null for full batch), got {self.batch_size}")
        if not self.weight_decay >= 0:
            raise ValueError(f"local.weight_decay must be >= 0, got {self.weight_decay}")
        if self.personal_lr is not None and not self.personal_lr > 0:
            raise ValueError(f"local.personal_lr must be > 0 (or null for local.lr), got {self.personal_lr}")

    def lr_at(self, round_idx: int) -> float:
        return self.lr * self.lr_decay**round_idx

    def personal_lr_at(self, round_idx: int) -> float:
        base = self.lr if self.personal_lr is None else self.personal_lr
        return base * self.lr_decay**round_idx
