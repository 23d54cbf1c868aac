"""Client-level TERM, tilted empirical risk minimization across clients (Li, Beirami, Sanjabi, Smith, ICLR 2021):
each client's update weighs as exp(t F_k), so t > 0 favours the clients the model serves worst.

Rule: docs/algorithms.md, section 30, (30.4)-(30.5).
"""

from __future__ import annotations

import math
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


class TERM(FedAvg):
    """FedAvg's local SGD; the server averages the updates with weights w_k exp(t F_k(w^t)), normalised (30.5).

    Args:
        tilt: t, a finite number; 0 is FedAvg (bitwise), t > 0 tilts toward the worst-served clients, t < 0 away.
        global_lr: the server step's scale.

    F_k(w^t) is the client's mean cross-entropy over its training set at the broadcast model (a data pass), as in
    ``QFFL``; the rule needs a classifier.
    """

    elementwise = False  # the upload's scale reads the client's loss
    record_level_dp = False
    linear_aggregate = True  # sums over clients of w_k e^{t F_k} d_k and of w_k e^{t F_k}
    upload_entries = ("delta",)

    def __init__(self, tilt: float = 1.0, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if isinstance(tilt, bool) or not isinstance(tilt, int | float) or not math.isfinite(tilt):
            raise ValueError(f"TERM tilt must be a finite number, got {tilt!r}")
        self.tilt = float(tilt)

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        delta = P.sub(params, ctx.broadcast["x"])
        if self.tilt == 0:
            return {"delta": delta}, ctx.client_state
        tilted = torch.exp(self.tilt * loss_at_broadcast(ctx))  # (30.4)
        dtype = next(iter(delta.values())).dtype
        return {"delta": P.scale(delta, tilted.to(dtype)), "tilt": {"weight": tilted.reshape(1).to(dtype)}}, ctx.client_state

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        if self.tilt == 0:
            return super().upload_sum(x, uploads, weights, info)
        total = next(iter(x.values())).new_zeros(1)
        for weight, upload in zip(torch.as_tensor(weights, dtype=torch.float64).tolist(), uploads):
            total = total + weight * upload["tilt"]["weight"]
        return {"delta": weighted_sum_or_zeros(P.part(uploads, "delta"), weights, x), "tilt": {"weight": total}}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """(30.5): the pseudo-gradient -sum_k w_k e^{t F_k} d_k / sum_k w_k e^{t F_k}."""
        if self.tilt == 0:
            return super().aggregate_sum(x, sums, server_state, info, local_steps)
        total = float(sums["tilt"]["weight"].sum())
        if not total > 0:  # no client reported
            return P.zeros_like(x), server_state
        return P.scale(sums["delta"], -1.0 / total), server_state
