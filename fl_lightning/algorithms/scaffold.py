"""SCAFFOLD, option II (Karimireddy et al. 2020, Alg. 1 and Eq. 4).

Rule: docs/algorithms.md, section 4, (4.1)-(4.3); checked properties: E3.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, weighted_sum_or_zeros
from fl_lightning.optim import control_variate_option2, sgd_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class SCAFFOLD(Algorithm):
    """Client: x_i <- x_i - eta_l (g - c_i + c); c_i+ = c_i - c + (x - x_i)/(K eta_l).

    Server: x <- x + eta_g sum_i w_i (x_i - x);  c <- c + (1/N) sum_{i in S} (c_i+ - c_i),
    so c stays the mean of all N clients' c_i (unseen clients hold c_i = 0).
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = True  # sums of w_i delta_i and of delta_c_i / N
    upload_entries = ("delta", "delta_c")
    mirrored_uploads = ("delta_c",)  # c = mean_i c_i

    def client_state_init(self, x: TensorDict) -> NestedState:
        return {"c": P.zeros_like(x)}

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {"c": P.zeros_like(x)}

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, "c": server_state["c"]}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(params)
        c_i, c = ctx.client_state["c"], ctx.broadcast["c"]
        return sgd_step(params, {k: grad[k] - c_i[k] + c[k] for k in grad}, ctx.lr), local

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        x, c_i = ctx.broadcast["x"], ctx.client_state["c"]
        c_new = control_variate_option2(c_i, ctx.broadcast["c"], x, params, ctx.num_steps, ctx.lr)
        return {"delta": P.sub(params, x), "delta_c": P.sub(c_new, c_i)}, {"c": c_new}

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        dc = weighted_sum_or_zeros(P.part(uploads, "delta_c"), [1.0 / info.num_clients] * len(uploads), x)
        return {**super().upload_sum(x, uploads, weights, info), "delta_c": dc}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate_sum(x, sums, server_state, info, local_steps)
        return pseudo_grad, {"c": P.add(server_state["c"], sums["delta_c"])}

    def metrics(self, server_state: NestedState, info: RoundInfo) -> dict[str, float]:
        """``algo/c_norm``: ||c||, the norm of the server control variate."""
        return {"c_norm": float(P.sq_norm(server_state["c"])) ** 0.5}
