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

from fl_lightning import params as P
from fl_lightning.params import TensorDict
from fl_lightning.state import NestedState


def history_init(x: TensorDict, depth: int) -> NestedState:
    """Empty history of ``depth`` increments (all zero)."""
    state: NestedState = {"x_prev": P.detach_clone(x), "steps": {"K": torch.ones((), dtype=torch.float64)}}
    for j in range(1, depth):
        state[f"delta_{j}"] = P.zeros_like(x)
    return state


def increments(x: TensorDict, state: NestedState, depth: int) -> list[TensorDict]:
    """``[delta_t, delta_{t-1}, ..., delta_{t-depth+1}]`` for the current global model ``x = x_t``."""
    k = state["steps"]["K"]
    newest = {n: (state["x_prev"][n] - v) / k for n, v in x.items()}
    return [newest] + [state[f"delta_{j}"] for j in range(1, depth)]


def history_update(x: TensorDict, state: NestedState, depth: int, local_steps: float) -> NestedState:
    """State after a round that started from ``x = x_t`` with mean local step count ``local_steps``."""
    deltas = increments(x, state, depth)
    new: NestedState = {"x_prev": P.detach_clone(x), "steps": {"K": torch.tensor(float(local_steps), dtype=torch.float64)}}
    for j in range(1, depth):
        new[f"delta_{j}"] = deltas[j - 1]
    return new
