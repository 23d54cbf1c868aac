"""FedMIM's inertial local step (Liu, Sun et al. 2023, Algorithm 1, lines 8-12): docs/algorithms.md, (8.3)."""

from __future__ import annotations

from fl_lightning.core.params import TensorDict


def inertial_step(params: TensorDict, grad: TensorDict, shift_alpha: TensorDict, alpha_sum: float, lr: float) -> TensorDict:
    """x_{k+1} = (x_k - sum_j alpha_j delta_{t-j}) - (1 - sum_j alpha_j) * lr * g.

    ``shift_alpha`` is the precombined ``sum_j alpha_j delta_{t-j}``; ``grad`` is taken
    at the shifted point ``x_k - sum_j beta_j delta_{t-j}`` by the caller.
    """
    step = (1.0 - alpha_sum) * lr
    return {k: (p - shift_alpha[k]) - step * grad[k] for k, p in params.items()}
