"""Global increments delta_t = -(x_t - x_{t-1}) / K as server state (FedCM, FedMIM).

docs/algorithms.md, (7.1) and (8.1).

The server keeps the previous global model and the J-1 older increments, so the
newest increment is read off the current x whatever the server optimizer did
(and is 0 in the first round: ``x_prev`` starts at x_0). K is the mean local step
count of the round that produced the increment.

State layout: ``{"x_prev": x_{t-1}, "steps": {"K": K_{t-1}}, "delta_1": delta_{t-1}, ...}``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def history_init(x: TensorDict, depth: int) -> NestedState:
    """Empty history of ``depth`` increments (all zero)."""
    state: NestedState = {"x_prev": P.detach_clone(x), "steps": {"K": torch.ones((), dtype=torch.float64)}}
    for j in range(1, depth):
        state[f"delta_{j}"] = P.zeros_like(x)
    return state


def increments(x: TensorDict, state: NestedState, depth: int) -> list[TensorDict]:
    """``[delta_t, delta_{t-1}, ..., delta_{t-depth+1}]`` for the current global model ``x = x_t``.

    ``state`` may hold clients stacked on a leading dimension (a client-kept history, K of shape [S]).
    """
    k = state["steps"]["K"]

    def per_row(t: Tensor) -> Tensor:  # a 0-dim K divides as a scalar (no dtype promotion); [S] K one row each
        return k if k.dim() == 0 else k.to(t.dtype).reshape(k.shape + (1,) * (t.dim() - 1))

    newest = {n: (state["x_prev"][n] - v) / per_row(state["x_prev"][n]) for n, v in x.items()}
    return [newest] + [state[f"delta_{j}"] for j in range(1, depth)]


def history_update(x: TensorDict, state: NestedState, depth: int, local_steps: float) -> NestedState:
    """State after a round that started from ``x = x_t`` with mean local step count ``local_steps``."""
    deltas = increments(x, state, depth)
    k = torch.full_like(state["steps"]["K"], float(local_steps))  # float64, shaped like the old K
    new: NestedState = {"x_prev": P.detach_clone(x), "steps": {"K": k}}
    for j in range(1, depth):
        new[f"delta_{j}"] = deltas[j - 1]
    return new
