"""Rules that weigh each client's update by its loss (docs/algorithms.md, section 30): the client uploads its update
scaled by a_k and a number b_k, and the server steps by the ratio of their weighted sums,
x <- x + s sum_k w_k a_k d_k / sum_k w_k b_k (q-FFL (30.2): a_k = F_k^q, b_k = h_k, s = L; TERM (30.5):
a_k = b_k = e^{t F_k}, s = 1). Both sums are over clients, so DDP adds the processes' partial sums."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Sequence

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientContext, RoundInfo, weighted_sum_or_zeros
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import Payload


def loss_at_broadcast(ctx: ClientContext) -> Tensor:
    """F_k(w^t): the mean cross-entropy of the broadcast model over the client's training samples (a data pass;
    padded rows, where clients run stacked, are masked out), in float64."""
    seen = ctx.data_pass(ctx.broadcast["x"])
    losses = torch.nn.functional.cross_entropy(seen.logits, seen.target, reduction="none")
    return ((losses * seen.mask).sum() / seen.mask.sum()).double()


class LossWeighted(FedAvg, metaclass=ABCMeta):
    """FedAvg's local SGD and the ratio-of-sums server step above; a subclass gives ``weigh`` (a_k, b_k),
    ``step_scale`` (s) and ``weighs`` (False: FedAvg's own rule, bitwise)."""

    elementwise = False  # a_k and b_k read the client's loss (and q-FFL the update's norm)
    record_level_dp = False
    linear_aggregate = True  # the sums over clients of w_k a_k d_k and of w_k b_k (upload_sum)
    upload_entries = ("delta",)  # b_k (``{"ratio": {"b": [1]}}``) is a number, not shaped like x

    @property
    @abstractmethod
    def weighs(self) -> bool:
        """Whether the setting weighs the clients (False: FedAvg's rule, bitwise)."""

    @abstractmethod
    def weigh(self, delta: TensorDict, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """(a_k, b_k) of a client with update ``delta`` = d_k, float64 scalars."""

    def step_scale(self, info: RoundInfo) -> float:
        return 1.0

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        delta = P.sub(params, ctx.broadcast["x"])  # d_k = w_bar_k - w
        if not self.weighs:
            return {"delta": delta}, ctx.client_state
        a, b = self.weigh(delta, ctx)
        dtype = next(iter(delta.values())).dtype
        return {"delta": P.scale(delta, a.to(dtype)), "ratio": {"b": b.reshape(1).to(dtype)}}, ctx.client_state

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        if not self.weighs:
            return super().upload_sum(x, uploads, weights, info)
        total = next(iter(x.values())).new_zeros(1)
        for weight, upload in zip(torch.as_tensor(weights, dtype=torch.float64).tolist(), uploads):
            total = total + weight * upload["ratio"]["b"]
        return {"delta": weighted_sum_or_zeros(P.part(uploads, "delta"), weights, x), "ratio": {"b": total}}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """The pseudo-gradient -s sum_k w_k a_k d_k / sum_k w_k b_k (no step where no client reported)."""
        if not self.weighs:
            return super().aggregate_sum(x, sums, server_state, info, local_steps)
        total = float(sums["ratio"]["b"].sum())
        if not total > 0:
            return P.zeros_like(x), server_state
        return P.scale(sums["delta"], -self.step_scale(info) / total), server_state
