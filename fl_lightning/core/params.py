"""Which tensors are federated, and arithmetic on tensor dicts.

A *tensor dict* (``TensorDict``) maps parameter names to tensors. Every client
update rule and every aggregation is written over tensor dicts so that the same
code serves one client or many clients stacked on a leading dimension.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

TensorDict = dict[str, Tensor]


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` matches a glob in ``patterns`` or lies under a module path in it.

    ``"head"`` matches ``head.weight`` and ``head.bias``; ``"*.bias"`` matches every bias.
    """
    return any(fnmatch.fnmatchcase(name, pat) or name.startswith(pat + ".") for pat in patterns)


def federated_names(model: nn.Module, personal_patterns: Sequence[str] = ()) -> list[str]:
    """Names of the trainable parameters shared through the server.

    Trainable means ``requires_grad``; a name matching ``personal_patterns``
    (see ``matches``) stays on the client and is excluded.
    """
    return [name for name, p in model.named_parameters() if p.requires_grad and not matches(name, personal_patterns)]


def personal_names(model: nn.Module, personal_patterns: Sequence[str]) -> list[str]:
    """Names of trainable parameters that match ``personal_patterns`` (kept per client)."""
    return [name for name, p in model.named_parameters() if p.requires_grad and matches(name, personal_patterns)]


def detach_clone(td: TensorDict) -> TensorDict:
    return {k: v.detach().clone() for k, v in td.items()}


def zeros_like(td: TensorDict) -> TensorDict:
    return {k: torch.zeros_like(v) for k, v in td.items()}


def add(a: TensorDict, b: TensorDict, alpha: float | Tensor = 1.0) -> TensorDict:
    """a + alpha * b."""
    return {k: a[k] + alpha * b[k] for k in a}


def sub(a: TensorDict, b: TensorDict) -> TensorDict:
    return {k: a[k] - b[k] for k in a}


def scale(a: TensorDict, factor: float | Tensor) -> TensorDict:
    return {k: v * factor for k, v in a.items()}


def weighted_sum(dicts: Sequence[TensorDict], weights: Sequence[float] | Tensor) -> TensorDict:
    """Sum_i weights[i] * dicts[i], accumulated in the dicts' dtype.

    Small tensors of all dicts are stacked and contracted with the weights in one op
    (per-op overhead, not arithmetic, dominates aggregating small models); large ones
    are accumulated in place, tensor by tensor, without a stacked copy.
    """
    if len(dicts) == 0:
        raise ValueError("weighted_sum needs at least one tensor dict")
    if isinstance(weights, Tensor) and isinstance(dicts, StackedDicts) and torch.compiler.is_compiling():
        # traced into the compiled round: the weights stay a tensor (no host read), each stacked tensor contracted once
        return {k: torch.tensordot(weights.to(v.dtype), v, dims=1) for k, v in dicts.stacked.items()}
    weights = weights.tolist() if isinstance(weights, Tensor) else [float(w) for w in weights]  # a tensor: one read, not one per client
    weight_tensors: dict[tuple, Tensor] = {}  # one per dtype and device, not one per tensor name
    out = {}
    for k in names(dicts):
        parts = across(dicts, k)
        if len(parts) == 1 and len(dicts) > 1:
            stacked = parts[0]
            key = (stacked.dtype, stacked.device)
            if key not in weight_tensors:
                weight_tensors[key] = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device)
            out[k] = torch.tensordot(weight_tensors[key], stacked, dims=1)
            continue
        out[k] = parts[0] * weights[0]
        for part, w in zip(parts[1:], weights[1:]):
            out[k].add_(part, alpha=w)
    return out


def mean(dicts: Sequence[TensorDict]) -> TensorDict:
    return weighted_sum(dicts, [1.0 / len(dicts)] * len(dicts))


def sq_norm(td: TensorDict) -> Tensor:
    """Squared Euclidean norm over all tensors of the dict (a 0-dim tensor)."""
    return sum((v.double() ** 2).sum() for v in td.values())


def row_sq_norms(dicts: Sequence[TensorDict]) -> list[float]:
    """``float(sq_norm(d))`` of every dict, in float64; a ``StackedDicts`` with one reduction per tensor, not one per dict."""
    if isinstance(dicts, StackedDicts):
        total = sum(v.double().square().reshape(len(dicts), -1).sum(1) for v in dicts.stacked.values())
        return total.tolist() if isinstance(total, Tensor) else [0.0] * len(dicts)
    return [float(sq_norm(d)) for d in dicts]


def num_bytes(tensors: Iterable[Tensor]) -> int:
    return sum([t.nbytes for t in tensors])  # numel() * element_size(), in one attribute read


STACK_LIMIT = 1 << 22
"""Elements up to which per-client tensors are stacked for one vectorized op; above
it the per-tensor ops' arithmetic outweighs their dispatch and stacking would copy."""


def across(dicts: Sequence[TensorDict], name: str) -> list[Tensor]:
    """Tensor ``name`` of every dict: as one stacked ``[S, ...]`` tensor if small, else one per dict."""
    if isinstance(dicts, StackedDicts):  # already stacked: that tensor (or its rows, as above when large)
        stacked = dicts.stacked[name]
        return [stacked] if 1 < len(dicts) and stacked.numel() <= STACK_LIMIT else list(stacked.unbind(0))
    tensors = [d[name] for d in dicts]
    if len(tensors) > 1 and tensors[0].numel() * len(tensors) <= STACK_LIMIT:
        source = getattr(dicts[0], "stacked", None)
        if source is not None:  # rows of one stacked tensor (``unstack_rows``): that tensor, not a copy
            stacked, views = source[0].get(name), source[1].get(name)
            if views is not None and len(tensors) <= len(views) and all(map(operator.is_, tensors, views)):
                return [stacked if len(tensors) == len(views) else stacked[: len(tensors)]]
        return [torch.stack(tensors)]
    return tensors


class StackedRow(dict):
    """One client's tensors, each a row of a stacked ``[S, ...]`` tensor (``unstack_rows``): a plain
    tensor dict to every reader; ``across`` of rows 0 .. n-1 returns the stacked tensor's first n rows
    instead of stacking the rows again (the same values and layout: a contiguous stacked tensor)."""

    __slots__ = ("stacked",)


def unstack_rows(stacked: TensorDict, num_rows: int) -> list[TensorDict]:
    """``stacked``'s rows as ``num_rows`` per-row tensor dicts (views, one ``unbind`` per tensor) that
    ``across`` turns back into ``stacked`` without a copy. Tensors that are not contiguous are stacked
    again by ``across`` (a copy of the layout ``torch.stack`` gives)."""
    views = {k: v.unbind(0) for k, v in stacked.items()}
    source = ({k: v for k, v in stacked.items() if v.is_contiguous()}, {k: views[k] for k, v in stacked.items() if v.is_contiguous()})
    keys, rows = tuple(views), []
    for parts in zip(*views.values()) if views else [()] * num_rows:
        row = StackedRow(zip(keys, parts))
        row.stacked = source
        rows.append(row)
    return rows



class StackedDicts(Sequence):
    """``size`` tensor dicts held as one dict of stacked ``[size, ...]`` tensors (a stacked round's uploads):
    ``across`` and ``weighted_sum`` read the stacked tensors; dict ``i`` (``unstack_rows``' row ``i``) is made
    only where a reader indexes it."""

    def __init__(self, stacked: TensorDict, size: int) -> None:
        self.stacked, self._size, self._rows = stacked, size, None

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if self._rows is None:
            self._rows = unstack_rows(self.stacked, self._size)
        return self._rows[index]


def names(dicts: Sequence[TensorDict]) -> Iterable[str]:
    """The tensor names of ``dicts`` (its first dict's; a ``StackedDicts``' without making a row)."""
    return dicts.stacked if isinstance(dicts, StackedDicts) else dicts[0]


def part(payloads: Sequence[dict[str, TensorDict]], name: str, default: TensorDict | None = None) -> Sequence[TensorDict]:
    """Part ``name`` of every payload, ``[p[name] for p in payloads]`` (``p.get(name, default)`` with a ``default``);
    stacked payloads (``StackedPayloads``) give their stacked part instead, without a dict per client."""
    own = getattr(payloads, "part", None)
    if own is not None:
        return own(name, default)
    return [p[name] for p in payloads] if default is None else [p.get(name, default) for p in payloads]
