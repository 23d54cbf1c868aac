"""FedCM, client-level momentum (Xu et al. 2021, Alg. 1).

Rule: docs/algorithms.md, section 7, (7.1)-(7.3); a = 1 is FedAvg (E1).
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.core import params as P
from fl_lightning.algorithms import increments as H
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, mean_steps
from fl_lightning.optim import sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class FedCM(Algorithm):
    """Server broadcasts Delta_t = -(x_t - x_{t-1}) / (K eta_l) (0 in the first round);
    client steps x_i <- x_i - eta_l (a g + (1 - a) Delta_t). Server as FedAvg.

    eta_l is this round's local lr, so eta_l * Delta_t is exactly the last global
    increment over K whatever the lr schedule (FedMIM with J = 1, beta = 0 is FedCM).

    Args:
        a: weight of the local gradient, in (0, 1] (1 is FedAvg).
        global_lr: server learning rate.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = True  # FedAvg's sum; the history update reads x and the local steps only

    def __init__(self, a: float = 0.1, global_lr: float = 1.0) -> None:
        super().__init__(global_lr)
        if not 0 < a <= 1:
            raise ValueError(f"FedCM a must be in (0, 1], got {a}")
        self.a = a

    def server_state_init(self, x: TensorDict) -> NestedState:
        return H.history_init(x, depth=1)

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        (delta,) = H.increments(x, server_state, depth=1)
        return {"x": x, "momentum": P.scale(delta, 1.0 / info.local_lr)}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        momentum = ctx.broadcast["momentum"]
        direction = {k: self.a * grad[k] + (1.0 - self.a) * momentum[k] for k in grad}
        return sgd_step(params, direction, ctx.lr), local

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate_sum(x, sums, server_state, info, local_steps)
        return pseudo_grad, H.history_update(x, server_state, 1, mean_steps(local_steps))
