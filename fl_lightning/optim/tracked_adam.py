"""Adam with a persistent second moment, the AMSGrad max and optional tracking shifts.

One step of Algorithm 1 (lines 10-18) of Chen et al., "Parameter Tracking in
Federated Learning with Adaptive Optimization" (FAdamET / FAdamGT):

    g_hat = g + grad_shift                         (GT: grad_shift = y - y_i)
    m     = beta1 m + (1 - beta1) g_hat
    v     = beta2 v + (1 - beta2) g_hat^2
    v_hat = max(v_hat, v)
    Delta = m / (sqrt(v_hat) + eps)
    x     = x - lr (scale * Delta + step_shift)    (ET: step_shift = y - y_i;
                                                    FedLADA: scale = a, step_shift = (1 - a) g_a)

No bias correction (the paper's rule); docs/algorithms.md, (11.2), (12.2), (12.4), (13.1).
Elementwise tensor ops only, over any set
of tensors (full models or LoRA adapters), so clients can be stacked and vmapped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


def adam_round_init(v: TensorDict) -> NestedState:
    """Per-round local state: m = 0 (reset each round), v = v_hat = the client's persisted v_i."""
    return {
        "m": {k: torch.zeros_like(t) for k, t in v.items()},
        "v": {k: t.clone() for k, t in v.items()},
        "v_hat": {k: t.clone() for k, t in v.items()},
    }


def adam_direction(
    grad: TensorDict, local: NestedState, betas: tuple[float, float], eps: float
) -> tuple[TensorDict, NestedState]:
    """Moment updates and the AMSGrad direction Delta = m / (sqrt(max(v_hat, v)) + eps)."""
    beta1, beta2 = betas
    m, v, v_hat, direction = {}, {}, {}, {}
    for k, g in grad.items():
        m[k] = beta1 * local["m"][k] + (1.0 - beta1) * g
        v[k] = beta2 * local["v"][k] + (1.0 - beta2) * g * g
        v_hat[k] = torch.maximum(local["v_hat"][k], v[k])
        direction[k] = m[k] / (v_hat[k].sqrt() + eps)
    return direction, {**local, "m": m, "v": v, "v_hat": v_hat}


def tracked_adam_step(
    params: TensorDict,
    grad: TensorDict,
    local: NestedState,
    lr: float | Tensor,
    betas: tuple[float, float] = (0.9, 0.99),
    eps: float = 1e-8,
    grad_shift: TensorDict | None = None,
    step_shift: TensorDict | None = None,
    scale: float = 1.0,
) -> tuple[TensorDict, NestedState]:
    """One local step; returns the new parameters and the new per-round state (m, v, v_hat)."""
    if grad_shift is not None:
        grad = {k: g + grad_shift[k] for k, g in grad.items()}
    direction, local = adam_direction(grad, local, betas, eps)
    if scale != 1.0:
        direction = {k: scale * d for k, d in direction.items()}
    if step_shift is not None:
        direction = {k: d + step_shift[k] for k, d in direction.items()}
    return {k: p - lr * direction[k] for k, p in params.items()}, local
