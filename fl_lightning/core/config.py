"""Dataclass settings of local training, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MAX_LOCAL_STEPS = 100_000
"""The most local steps one client may take in one round (``local.steps``, or ``local.epochs`` x
ceil(client size / batch_size)): checked before any training, so that a typo such as
``local.steps 1e9`` ends in one line instead of a multi-GB batch index and a hang."""


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
        lr_schedule: ``"exponential"`` (round t uses ``lr * lr_decay**t``), ``"inv_sqrt"``
            (``lr / sqrt(t + 1)``, the 1/sqrt(k) step of k = t + 1 in Rostami & Kia's
            FedAvg baseline; needs ``lr_decay = 1``), ``"cosine"`` (from ``lr`` after the
            warmup down to ``min_lr`` at round ``schedule_rounds``, then ``min_lr``) or
            ``"step"`` (``lr * lr_decay**(t // step_rounds)``).
        warmup_rounds: rounds of linear warmup before the schedule, >= 0: round t < w uses
            ``lr * (t + 1) / (w + 1)`` (``cosine`` and ``step`` only).
        schedule_rounds: the cosine schedule's length in rounds (warmup included), > warmup_rounds;
            usually ``trainer.max_steps``.
        min_lr: the cosine schedule's final lr, in [0, lr).
        step_rounds: rounds between two ``lr_decay`` steps of the ``step`` schedule, >= 1.
        personal_lr: step size gamma_v of personal tensors, > 0 (``None``: same as
            ``lr``); follows ``lr_schedule`` like ``lr``. Used by personalization algorithms
            (``ctx.personal_lr``), also for a personal model kept as client state (Ditto, pFedMe).
    """

    lr: float = 0.1
    lr_decay: float = 1.0
    steps: int | None = 10
    epochs: int | None = None
    batch_size: int | None = 32
    weight_decay: float = 0.0
    lr_schedule: Literal["exponential", "inv_sqrt", "cosine", "step"] = "exponential"
    personal_lr: float | None = None
    warmup_rounds: int = 0
    schedule_rounds: int | None = None
    min_lr: float = 0.0
    step_rounds: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.lr < math.inf:
            raise ValueError(f"local.lr must be > 0 and finite, got {self.lr}")
        if not 0 < self.lr_decay <= 1:
            raise ValueError(f"local.lr_decay must be in (0, 1], got {self.lr_decay}")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"set exactly one of local.steps and local.epochs, got steps={self.steps}, epochs={self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"local.steps must be >= 1, got {self.steps}")
        if self.steps is not None and self.steps > MAX_LOCAL_STEPS:
            raise ValueError(
                f"local.steps must be in [1, {MAX_LOCAL_STEPS}] (local steps per client per round), got {self.steps}"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"local.epochs must be >= 1, got {self.epochs}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"local.batch_size must be >= 1 (or null for full batch), got {self.batch_size}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"local.weight_decay must be >= 0, got {self.weight_decay}")
        if self.lr_schedule not in ("exponential", "inv_sqrt", "cosine", "step"):
            raise ValueError(
                f"local.lr_schedule must be 'exponential', 'inv_sqrt', 'cosine' or 'step', got {self.lr_schedule!r}"
            )
        if isinstance(self.warmup_rounds, bool) or not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise ValueError(f"local.warmup_rounds must be an integer >= 0, got {self.warmup_rounds!r}")
        if self.warmup_rounds and self.lr_schedule not in ("cosine", "step"):
            raise ValueError(f"local.warmup_rounds needs lr_schedule 'cosine' or 'step', got {self.lr_schedule!r}")
        if self.lr_schedule == "cosine":
            if self.schedule_rounds is None or not self.schedule_rounds > self.warmup_rounds:
                raise ValueError(
                    f"local.schedule_rounds must be > local.warmup_rounds={self.warmup_rounds} with lr_schedule 'cosine' "
                    f"(usually trainer.max_steps), got {self.schedule_rounds}"
                )
            if not 0 <= self.min_lr < self.lr:
                raise ValueError(f"local.min_lr must be in [0, local.lr={self.lr}), got {self.min_lr}")
        if self.lr_schedule == "step" and (self.step_rounds is None or self.step_rounds < 1):
            raise ValueError(f"local.step_rounds must be >= 1 with lr_schedule 'step', got {self.step_rounds}")
        if self.lr_schedule == "inv_sqrt" and self.lr_decay != 1:
            raise ValueError(f"local.lr_decay must be 1 with lr_schedule 'inv_sqrt' (the schedules do not compose), got {self.lr_decay}")
        if self.personal_lr is not None and not self.personal_lr > 0:
            raise ValueError(f"local.personal_lr must be > 0 (or null for local.lr), got {self.personal_lr}")

    def lr_factor(self, round_idx: int) -> float:
        """The ``cosine``/``step`` schedules' multiplier of the base lr at round ``round_idx`` (0-based)."""
        if round_idx < self.warmup_rounds:
            return (round_idx + 1) / (self.warmup_rounds + 1)
        if self.lr_schedule == "step":
            return self.lr_decay ** ((round_idx - self.warmup_rounds) // self.step_rounds)
        span = self.schedule_rounds - self.warmup_rounds
        progress = min(1.0, (round_idx - self.warmup_rounds) / span)
        floor = self.min_lr / self.lr
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, round_idx: int) -> float:
        """eta_l of round ``round_idx`` under ``lr_schedule``."""
        return self._scheduled(self.lr, round_idx)

    def personal_lr_at(self, round_idx: int) -> float:
        """gamma_v of round ``round_idx``: ``personal_lr`` (default ``lr``) under the same schedule."""
        return self._scheduled(self.lr if self.personal_lr is None else self.personal_lr, round_idx)

    def _scheduled(self, base: float, round_idx: int) -> float:
        if self.lr_schedule == "inv_sqrt":
            return base / math.sqrt(round_idx + 1)
        if self.lr_schedule in ("cosine", "step"):
            return base * self.lr_factor(round_idx)
        return base * self.lr_decay**round_idx
