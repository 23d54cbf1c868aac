"""Client-level TERM, tilted empirical risk minimization across clients (Li, Beirami, Sanjabi, Smith, ICLR 2021):
each client's update weighs as exp(t F_k), so t > 0 favours the clients the model serves worst.

Rule: docs/algorithms.md, section 30, (30.4)-(30.5).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext
from fl_lightning.algorithms.loss_weighted import LossWeighted, loss_at_broadcast
from fl_lightning.core.params import TensorDict


class TERM(LossWeighted):
    """a_k = b_k = exp(t F_k(w^t)) (30.4): the updates averaged with the tilted weights, normalised (30.5).

    Args:
        tilt: t, a finite number; 0 is FedAvg (bitwise), t > 0 tilts toward the worst-served clients, t < 0 away.
        global_lr: the server step's scale.

    F_k(w^t) is the client's mean cross-entropy over its training set at the broadcast model (a data pass), as in
    ``QFFL``; the rule needs a classifier.
    """

    def __init__(self, tilt: float = 1.0, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(tilt, bool) or not isinstance(tilt, int | float) or not math.isfinite(tilt):
            raise ValueError(f"TERM tilt must be a finite number, got {tilt!r}")
        self.tilt = float(tilt)

    @property
    def weighs(self) -> bool:
        return self.tilt != 0

    def weigh(self, delta: TensorDict, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        tilted = torch.exp(self.tilt * loss_at_broadcast(ctx))  # (30.4)
        return tilted, tilted
