"""Scaffold-P (Chen, Cao, Yuan and Wen 2023, Algorithm 2): FedAvg-P plus SCAFFOLD
control variates on the shared tensors u only.

Rule: docs/algorithms.md, section 15, (15.1)-(15.4); reduction to SCAFFOLD: E6.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, Payload, RoundInfo
from fl_lightning.algorithms.fedavg_p import FedAvgP, split_sgd_step
from fl_lightning.algorithms.scaffold import SCAFFOLD
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class ScaffoldP(FedAvgP):
    """Client: u_i <- u_i - gamma_u (grad_u F - c_i + c), v_i <- v_i - gamma_v grad_v F (lines 6-7);
    c_i+ = c_i - c + (u - u_i)/(K gamma_u) (line 10). Server: u as FedAvg-P (line 12),
    c <- c + (1/n) sum_S (c_i+ - c_i) (line 13).

    Args:
        eta_u, eta_v: outer step sizes as in FedAvg-P.
        warm_start: initialise c_i^0 = (1/K) sum_k grad_u F(u^0, v_i^0; xi_{i,k}) and
            c^0 = mean_i c_i^0 with a pass over all n clients before round 0 (Alg. 2 input);
            ``False`` starts from c_i = c = 0 (SCAFFOLD's initialisation).
    """

    def __init__(self, eta_u: float = 1.0, eta_v: float = 1.0, warm_start: bool = True) -> None:
        super().__init__(eta_u=eta_u, eta_v=eta_v)
        self.warm_start = warm_start
        self.warmup_pass = warm_start

    mirrored_uploads = SCAFFOLD.mirrored_uploads  # c = mean_i c_i

    # SCAFFOLD's control-variate state and broadcast; x holds only the shared part u here.
    client_state_init = SCAFFOLD.client_state_init
    server_state_init = SCAFFOLD.server_state_init
    broadcast = SCAFFOLD.broadcast
    metrics = SCAFFOLD.metrics

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        c, c_i = ctx.broadcast["c"], ctx.client_state["c"]
        direction = {k: g - c_i[k] + c[k] if k in c else g for k, g in grad.items()}
        return split_sgd_step(params, direction, ctx), local

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        x, c, c_i = ctx.broadcast["x"], ctx.broadcast["c"], ctx.client_state["c"]
        delta = P.sub(params, x)
        c_new = {k: c_i[k] - c[k] - delta[k] / (ctx.num_steps * ctx.lr) for k in c_i}
        return {"delta": delta, "delta_c": P.sub(c_new, c_i)}, {"c": c_new}

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate(x, uploads, weights, server_state, info, local_steps)
        n = info.num_clients
        c = P.add(server_state["c"], P.weighted_sum(P.part(uploads, "delta_c"), [1.0 / n] * len(uploads)))
        return pseudo_grad, {"c": c}

    def client_warmup(self, params: TensorDict, ctx: ClientContext) -> tuple[Payload, NestedState]:
        grad = ctx.mean_grad(params)
        c_i = {k: grad[k] for k in ctx.broadcast["x"]}
        return {"c": c_i}, {"c": c_i}

    def server_warmup(
        self, x: TensorDict, uploads: Sequence[Payload], server_state: NestedState, info: RoundInfo
    ) -> NestedState:
        return {"c": P.mean(P.part(uploads, "c"))}
