"""FedMIM, multi-step inertial momentum (Liu, Sun et al. 2023, Algorithm 1).

Rule: docs/algorithms.md, section 8, (8.1)-(8.4); reductions E1 (to FedAvg) and E2 (to FedCM);
where the code departs from the paper (broadcast of the shifts): section 8, "Code vs paper".
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning import params as P
from fl_lightning.algorithms import increments as H
from fl_lightning.algorithms.base import Algorithm, ClientContext, Payload, RoundInfo, mean_steps
from fl_lightning.optim import inertial_step
from fl_lightning.params import TensorDict
from fl_lightning.state import NestedState


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

    Server: x_{t+1} = sum_i w_i x_{i,K} (FedAvg with global_lr = 1). The server keeps
    the increment history and broadcasts the two combined shifts
    ``sum_j alpha_j delta_{t-j}`` and ``sum_j beta_j delta_{t-j}`` (2 model sizes, whatever J:
    a client absent last round cannot know the history otherwise).
    Our alpha_0 / beta_0 are the paper's alpha_1 / beta_1 (the newest increment).

    Args:
        inertial_steps: J >= 1.
        alpha: J weights >= 0 with sum < 1 (the paper's best: [0.6, 0.3]).
        beta: J weights >= 0 (the paper's best: [0.9, 0.1]).
        global_lr: server learning rate (1 in the paper).
    """

    elementwise = True

    def __init__(
        self,
        inertial_steps: int = 2,
        alpha: list[float] = (0.6, 0.3),
        beta: list[float] = (0.9, 0.1),
        global_lr: float = 1.0,
    ) -> None:
        super().__init__(global_lr)
        if not inertial_steps >= 1:
            raise ValueError(f"FedMIM inertial_steps must be >= 1, got {inertial_steps}")
        self.inertial_steps = inertial_steps
        self.alpha = _weights("alpha", alpha, inertial_steps)
        self.beta = _weights("beta", beta, inertial_steps)
        if not sum(self.alpha) < 1:
            raise ValueError(f"FedMIM alpha must sum to < 1, got sum({self.alpha}) = {sum(self.alpha)}")
        self.alpha_sum = sum(self.alpha)

    def server_state_init(self, x: TensorDict) -> NestedState:
        return H.history_init(x, self.inertial_steps)

    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        deltas = H.increments(x, server_state, self.inertial_steps)
        return {"x": x, "shift_alpha": P.weighted_sum(deltas, self.alpha), "shift_beta": P.weighted_sum(deltas, self.beta)}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        _, grad = ctx.grad(P.sub(params, ctx.broadcast["shift_beta"]))
        return inertial_step(params, grad, ctx.broadcast["shift_alpha"], self.alpha_sum, ctx.lr), local

    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        pseudo_grad, _ = super().aggregate(x, uploads, weights, server_state, info, local_steps)
        return pseudo_grad, H.history_update(x, server_state, self.inertial_steps, mean_steps(local_steps))
