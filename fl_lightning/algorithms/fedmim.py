"""FedMIM, multi-step inertial momentum (Liu, Sun et al. 2023, Algorithm 1).

Rule: docs/algorithms.md, section 8, (8.1)-(8.4); reductions E1 (to FedAvg) and E2 (to FedCM);
where the code departs from the paper (broadcast of the shifts): section 8, "Code vs paper".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal


from fl_lightning.core import params as P
from fl_lightning.algorithms import increments as H
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, mean_steps
from fl_lightning.optim import inertial_step
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def _weights(name: str, values: Sequence[float], steps: int) -> list[float]:
    values = [float(v) for v in values]
    if len(values) != steps:
        raise ValueError(f"FedMIM {name} must have inertial_steps={steps} entries, got {len(values)}: {values}")
    if any(not v >= 0 for v in values):
        raise ValueError(f"FedMIM {name} entries must be >= 0, got {values}")
    return values


class FedMIM(Algorithm):
    """Each local step, with delta_{t-j} = -(x_{t-j} - x_{t-j-1})/K the last J global increments:

        y1 = x_{i,k} - sum_j alpha_j delta_{t-j}
        y2 = x_{i,k} - sum_j beta_j delta_{t-j}
        x_{i,k+1} = y1 - (1 - sum_j alpha_j) eta_l grad f_i(y2; xi)      (one gradient per step)

    Server: x_{t+1} = sum_i w_i x_{i,K} (FedAvg with global_lr = 1).
    Our alpha_0 / beta_0 are the paper's alpha_1 / beta_1 (the newest increment).

    Where the history lives (docs/algorithms.md, section 8, "Code vs paper"):

    - ``history="server"`` (default): the server keeps the increment history and broadcasts
      the two combined shifts ``sum_j alpha_j delta_{t-j}`` and ``sum_j beta_j delta_{t-j}``
      (3 model sizes down, whatever J): exact for every client, also one absent last round.
    - ``history="client"`` (the paper's convention): only x_t is sent (1 model size down);
      each client keeps the global models it received and takes the increments between
      them, normalised by its own K. Equal to the server mode under full participation; a
      client that skipped rounds uses increments spanning the rounds it missed, and a client
      new to training starts from zero increments.

    Args:
        inertial_steps: J >= 1.
        alpha: J weights >= 0 with sum < 1 (the paper's best: [0.6, 0.3]).
        beta: J weights >= 0 (the paper's best: [0.9, 0.1]).
        global_lr: server learning rate (1 in the paper).
        history: ``"server"`` or ``"client"``, see above.
    """

    elementwise = True
    record_level_dp = True  # per-example objective, one ctx.grad per step (docs/privacy.md, record-level DP-SGD)
    linear_aggregate = True  # FedAvg's sum; the history update reads x and the local steps only
    upload_entries = ("delta",)

    def __init__(
        self,
        inertial_steps: int = 2,
        alpha: list[float] = (0.6, 0.3),
        beta: list[float] = (0.9, 0.1),
        global_lr: float = 1.0,
        history: Literal["server", "client"] = "server",
    ) -> None:
        super().__init__(global_lr)
        if history not in ("server", "client"):
            raise ValueError(f"FedMIM history must be 'server' or 'client', got {history!r}")
        self.history = history
        if not inertial_steps >= 1:
            raise ValueError(f"FedMIM inertial_steps must be >= 1, got {inertial_steps}")
        self.inertial_steps = inertial_steps
        self.alpha = _weights("alpha", alpha, inertial_steps)
        self.beta = _weights("beta", beta, inertial_steps)
        if not sum(self.alpha) < 1:
            raise ValueError(f"FedMIM alpha must sum to < 1, got sum({self.alpha}) = {sum(self.alpha)}")
        self.alpha_sum = sum(self.alpha)

    def server_state_init(self, x: TensorDict) -> NestedState:
        return H.history_init(x, self.inertial_steps) if self.history == "server" else {}

    def client_state_init(self, x: TensorDict) -> NestedState:
        return H.history_init(x, self.inertial_steps) if self.history == "client" else {}

    def _shifts(self, x: TensorDict, history: NestedState) -> Payload:
        deltas = H.increments(x, history, self.inertial_steps)
        return {"shift_alpha": P.weighted_sum(deltas, self.alpha), "shift_beta": P.weighted_sum(deltas, self.beta)}

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x, **self._shifts(x, server_state)} if self.history == "server" else {"x": x}

    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        return self._shifts(ctx.broadcast["x"], ctx.client_state) if self.history == "client" else {}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        shifts = ctx.broadcast if self.history == "server" else local
        _, grad = ctx.grad(P.sub(params, shifts["shift_beta"]))
        return inertial_step(params, grad, shifts["shift_alpha"], self.alpha_sum, ctx.lr), local

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        upload, state = super().client_finish(params, local, ctx)
        if self.history == "client":  # the client's own record: x_t and the increments it has seen
            x = {k: v.expand_as(params[k]) for k, v in ctx.broadcast["x"].items()}  # stacked clients: one row each
            state = H.history_update(x, ctx.client_state, self.inertial_steps, ctx.num_steps)
        return upload, state

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate_sum(x, sums, server_state, info, local_steps)
        if self.history == "client":
            return pseudo_grad, server_state
        return pseudo_grad, H.history_update(x, server_state, self.inertial_steps, mean_steps(local_steps))
