"""Plain SGD on tensor dicts."""

from __future__ import annotations

import torch
from torch import Tensor
from torch._C._functorch import is_batchedtensor

from fl_lightning.params import TensorDict


def sgd_step(params: TensorDict, direction: TensorDict, lr: float | Tensor) -> TensorDict:
    """x <- x - lr * direction, for every tensor of the dict.

    Rounded exactly as ``p - (lr * d)`` (a multiply, then a subtract; no fused
    multiply-add): the exact reductions between algorithms (FedMIM/FedCM/FedProx
    to FedAvg) are bitwise only if every rule rounds the same way. Computed as
    ``(-lr * d) + p`` (negation and commutation are exact) in two fused
    ``_foreach`` calls, one of them in place: on small models allocation and
    dispatch, not arithmetic, are the cost of a step. ``vmap`` has no batching
    rule for ``_foreach`` ops, so batched tensors take the per-tensor form.
    """
    keys = list(params)
    values = [params[k] for k in keys]
    if any(is_batchedtensor(v) or v.requires_grad for v in values):
        return {k: p - lr * direction[k] for k, p in params.items()}
    stepped = torch._foreach_mul([direction[k] for k in keys], -lr)
    torch._foreach_add_(stepped, values)
    return dict(zip(keys, stepped))
