"""Plain SGD on tensor dicts."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._C._functorch import is_batchedtensor

from fl_lightning.core.params import TensorDict


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
    directions = [direction[k] for k in keys]
    stepped = torch._foreach_mul(directions, _factor(-lr, directions))
    torch._foreach_add_(stepped, values)
    return dict(zip(keys, stepped))


_SCALAR_DTYPES = (torch.float32, torch.float64)


def _factor(value: float | Tensor, tensors: list[Tensor]) -> float | Tensor:
    """The multiplier ``value`` for ``_foreach_mul`` over ``tensors``: where they are all CPU tensors of
    one dtype of ``_SCALAR_DTYPES``, a 0-dim tensor of that dtype, made once per step size (a round's
    clients share it); else ``value`` itself.

    A CPU op wraps a Python number into a 0-dim float64 tensor and casts it to the tensors' dtype,
    at every call: that makes ``_foreach_mul`` by a number cost about twice ``_foreach_mul`` by the
    already cast tensor (some microseconds a step, a real share of a small model's step). The
    product is bit for bit the same: the same float64 value rounded once to the same dtype. Half
    precision is left out: its kernel reads the number at float precision, not at its own.
    """
    if type(value) is not float or not tensors:
        return value
    dtype = tensors[0].dtype
    if dtype not in _SCALAR_DTYPES or not tensors[0].is_cpu or any(t.dtype != dtype for t in tensors):
        return value
    return _scalar_tensor(value, dtype)


@functools.lru_cache(maxsize=16)
def _scalar_tensor(value: float, dtype: torch.dtype) -> Tensor:
    """``value`` as a 0-dim CPU tensor of ``dtype`` (shared: never written to)."""
    return torch.scalar_tensor(value, dtype=dtype)
