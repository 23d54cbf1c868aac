"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020, Alg. 2): clients with a higher loss get a larger
say in the server step, which lowers the spread of accuracy across clients.

Rule: docs/algorithms.md, section 30, (30.1)-(30.3).
"""

from __future__ import annotations

import math

from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, RoundInfo
from fl_lightning.algorithms.loss_weighted import LossWeighted, loss_at_broadcast
from fl_lightning.core.params import TensorDict


class QFFL(LossWeighted):
    """a_k = F_k^q and b_k = h_k of (30.1), the step scaled by L (30.2).

    Args:
        q: the fairness exponent, >= 0; 0 is FedAvg (the same aggregate, bitwise).
        lipschitz: L, the Lipschitz estimate of the local gradients; ``None`` (the default): 1 / the local learning
            rate of the round, the paper's choice.
        global_lr: the server step's scale (1: the paper's step).

    F_k(w^t) is the client's mean cross-entropy over its whole training set at the broadcast model (a data pass
    per client and round), so the rule needs a classifier.
    """

    def __init__(self, q: float = 1.0, lipschitz: float | None = None, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 <= q < math.inf:
            raise ValueError(f"QFFL q must be a number >= 0, got {q!r}")
        if lipschitz is not None and not 0 < lipschitz < math.inf:
            raise ValueError(f"QFFL lipschitz must be > 0 (or null: 1 / local.lr), got {lipschitz!r}")
        self.q, self.lipschitz = float(q), lipschitz

    @property
    def weighs(self) -> bool:
        return self.q != 0

    def _lipschitz(self, local_lr: float) -> float:
        return self.lipschitz if self.lipschitz is not None else 1.0 / local_lr

    def weigh(self, delta: TensorDict, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        loss = loss_at_broadcast(ctx)  # F_k(w^t)
        lipschitz = self._lipschitz(ctx.lr)
        squared = sum((t.double() ** 2).sum() for t in delta.values()) * lipschitz**2  # ||Delta w_k||^2, Delta w_k = -L d_k
        scale = loss**self.q
        return scale, self.q * loss ** (self.q - 1) * squared + lipschitz * scale  # (30.1)

    def step_scale(self, info: RoundInfo) -> float:
        return self._lipschitz(info.local_lr)
