"""Plain SGD on tensor dicts."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.params import TensorDict


def sgd_step(params: TensorDict, direction: TensorDict, lr: float | Tensor) -> TensorDict:
    """x <- x - lr * direction, for every tensor of the dict (one fused foreach op)."""
    keys = list(params)
    if isinstance(lr, Tensor) or torch._C._are_functorch_transforms_active():  # vmap has no foreach rule
        return {k: p - lr * direction[k] for k, p in params.items()}
    updated = torch._foreach_add([params[k] for k in keys], [direction[k] for k in keys], alpha=-lr)
    return dict(zip(keys, updated))
