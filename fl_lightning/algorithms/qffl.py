"""q-FFL / q-FedAvg (Li, Sanjabi, Beirami, Smith, ICLR 2020, Alg. 2): clients with a higher loss get a larger
say in the server step, which lowers the spread of accuracy across clients.

Rule: docs/algorithms.md, section 30, (30.1)-(30.3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, RoundInfo, weighted_sum_or_zeros
from fl_lightning.algorithms.client_loss import loss_at_broadcast
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import Payload


class QFFL(FedAvg):
    """FedAvg's local SGD; the client uploads F_k^q d_k and h_k (30.1), the server steps by their ratio (30.2).

    Args:
        q: the fairness exponent, >= 0; 0 is FedAvg (the same aggregate, bitwise).
        lipschitz: L, the Lipschitz estimate of the local gradients; ``None`` (the default): 1 / the local learning
            rate of the round, the paper's choice.
        global_lr: the server step's scale (1: the paper's step).

    F_k(w^t) is the client's mean cross-entropy over its whole training set at the broadcast model (a data pass
    per client and round), so the rule needs a classifier.
    """

    elementwise = False  # h_k reads the norm of the whole update
    record_level_dp = False
    linear_aggregate = True  # sums over clients of w_k F_k^q d_k and of w_k h_k (upload_sum)
    upload_entries = ("delta",)  # h_k (``{"h": [1]}``) is a number, not shaped like x

    def __init__(self, q: float = 1.0, lipschitz: float | None = None, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 <= q < float("inf"):
            raise ValueError(f"QFFL q must be a number >= 0, got {q!r}")
        if lipschitz is not None and not 0 < lipschitz < float("inf"):
            raise ValueError(f"QFFL lipschitz must be > 0 (or null: 1 / local.lr), got {lipschitz!r}")
        self.q, self.lipschitz = float(q), lipschitz

    def _lipschitz(self, local_lr: float) -> float:
        return self.lipschitz if self.lipschitz is not None else 1.0 / local_lr

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        x = ctx.broadcast["x"]
        delta = P.sub(params, x)  # d_k = w_bar_k - w
        if self.q == 0:
            return {"delta": delta}, ctx.client_state
        loss = loss_at_broadcast(ctx)  # F_k(w^t)
        lipschitz = self._lipschitz(ctx.lr)
        squared = sum((t.double() ** 2).sum() for t in delta.values()) * lipschitz**2  # ||Delta w_k||^2, Delta w_k = -L d_k
        scale = loss**self.q
        h = self.q * loss ** (self.q - 1) * squared + lipschitz * scale  # (30.1)
        dtype = next(iter(delta.values())).dtype
        return {"delta": P.scale(delta, scale.to(dtype)), "h": {"h": h.reshape(1).to(dtype)}}, ctx.client_state

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        if self.q == 0:
            return super().upload_sum(x, uploads, weights, info)
        total = next(iter(x.values())).new_zeros(1)
        for weight, upload in zip(torch.as_tensor(weights, dtype=torch.float64).tolist(), uploads):
            total = total + weight * upload["h"]["h"]
        return {"delta": weighted_sum_or_zeros(P.part(uploads, "delta"), weights, x), "h": {"h": total}}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """(30.2): the pseudo-gradient sum_k w_k F_k^q L (w - w_bar_k) / sum_k w_k h_k."""
        if self.q == 0:
            return super().aggregate_sum(x, sums, server_state, info, local_steps)
        h = float(sums["h"]["h"].sum())
        if not h > 0:  # no client reported (or every loss zero): no step
            return P.zeros_like(x), server_state
        return P.scale(sums["delta"], -self._lipschitz(info.local_lr) / h), server_state

