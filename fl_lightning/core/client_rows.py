"""Clients as rows of one batch: S clients' models evaluated by one forward of the shared model.

Batched execution holds S clients' parameters stacked ``[S, ...]`` and their batches ``[S, B, ...]``.
For a model whose class declares ``independent_rows = True`` (each sample's output depends on that
sample alone: no batch statistics, no mixing across the batch), the batches are concatenated into
one ordinary batch of S*B rows, client-major, and every layer whose parameters are stacked applies
client i's parameters to client i's rows:

- ``nn.Linear``: a batched matmul over the client index;
- ``nn.Conv2d``: one grouped convolution with the clients' channels side by side;
- ``nn.GroupNorm``: the normalisation of each row as usual, then client i's affine parameters.

Layers without stacked parameters (a frozen base, activations, pooling) run once over all rows.
This needs no ``vmap`` through the model's code (which forbids branching on tensor values, as
transformers' masking code does) and costs one forward's overheads for all clients.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fl_lightning.core.capabilities import declared
from fl_lightning.core.params import TensorDict


class UnsupportedLayer(Exception):
    """A substituted tensor lies in a layer ``ClientRows`` has no rule for (clients are then stacked by vmap)."""


def model_declares(model: nn.Module, capability: str) -> bool:
    """Whether ``model`` declares ``capability`` (e.g. ``independent_rows``): set on the instance (a model
    whose independence depends on its configuration, e.g. its normalisation) or by a class that is
    (a subclass of) the class defining ``forward``, so a subclass with its own ``forward`` does not
    inherit the claim by accident (``fl_lightning.core.capabilities``)."""
    return declared(model, capability, ("forward",))


def _clients(weight: Tensor, bias: Tensor | None, shared_dim: int) -> int:
    return weight.shape[0] if weight.dim() > shared_dim else bias.shape[0]


def client_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``nn.Linear`` with client i's weights on client i's rows.

    ``x``: ``[S*B, ..., in]``, client-major; ``weight``: ``[S, out, in]`` (or shared ``[out, in]``);
    ``bias``: ``[S, out]``, ``[out]`` or None.
    """
    clients = _clients(weight, bias, 2)
    if weight.dim() == 2:
        rows = F.linear(x, weight).reshape(clients, -1, weight.shape[0])
    else:
        rows = torch.bmm(x.reshape(clients, -1, x.shape[-1]), weight.transpose(1, 2))
    if bias is not None:
        rows = rows + (bias.unsqueeze(1) if bias.dim() == 2 else bias)
    return rows.reshape(*x.shape[:-1], rows.shape[-1])


def client_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, conv: nn.Conv2d) -> Tensor:
    """``conv`` (groups 1, zero padding) with client i's kernels on client i's images: one grouped
    convolution, the clients' channels side by side (the fastest of unfold+bmm, a loop over clients
    and this, measured on a CPU; it is also what vmap does).

    ``x``: ``[S*B, C, H, W]``; ``weight``: ``[S, O, C, kh, kw]`` (or shared); ``bias``: ``[S, O]``, ``[O]`` or None.
    """
    clients = _clients(weight, bias, 4)
    if weight.dim() == 4:
        out = F.conv2d(x, weight, None, conv.stride, conv.padding, conv.dilation)
    else:
        channels_out, channels_in = weight.shape[1], weight.shape[2]
        batch = x.shape[0] // clients
        side_by_side = x.view(clients, batch, channels_in, *x.shape[2:]).transpose(0, 1).reshape(batch, clients * channels_in, *x.shape[2:])
        stacked_bias = bias.reshape(-1) if bias is not None and bias.dim() == 2 else None
        out = F.conv2d(side_by_side, weight.flatten(0, 1), stacked_bias, conv.stride, conv.padding, conv.dilation, groups=clients)
        out = out.view(batch, clients, channels_out, *out.shape[2:]).transpose(0, 1).reshape(clients * batch, channels_out, *out.shape[2:])
        if stacked_bias is not None:
            return out
    if bias is not None:
        out = (out.view(clients, -1, *out.shape[1:]) + _per_channel(bias, out.dim() + 1)).flatten(0, 1)
    return out


def client_group_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, norm: nn.GroupNorm) -> Tensor:
    """``norm`` with client i's affine parameters on client i's rows (``[S, C]``, or shared ``[C]``)."""
    out = F.group_norm(x, norm.num_groups, None, None, norm.eps)
    clients = next(t.shape[0] for t in (weight, bias) if t is not None and t.dim() == 2)
    out = out.view(clients, -1, *out.shape[1:])
    if weight is not None:
        out = out * _per_channel(weight, out.dim())
    if bias is not None:
        out = out + _per_channel(bias, out.dim())
    return out.flatten(0, 1)


def _per_channel(t: Tensor, dims: int) -> Tensor:
    """``[S, C]`` or ``[C]`` shaped to broadcast over ``[S, B, C, ...]`` of ``dims`` dimensions."""
    if t.dim() == 1:
        return t.view(-1, *([1] * (dims - 3)))
    return t.view(t.shape[0], 1, t.shape[1], *([1] * (dims - 3)))


def _rule(module: nn.Module, attr: str):
    """The client-rows forward of ``module`` for a substituted ``attr``, or None."""
    kind = type(module)
    if kind is nn.Linear and attr in ("weight", "bias"):
        return lambda m, w, b: functools.partial(client_linear, weight=w, bias=b)
    if kind is nn.Conv2d and attr in ("weight", "bias") and module.groups == 1 and module.padding_mode == "zeros" \
            and not isinstance(module.padding, str):  # fmt: skip
        return lambda m, w, b: functools.partial(client_conv2d, weight=w, bias=b, conv=m)
    if kind is nn.GroupNorm and attr in ("weight", "bias"):
        return lambda m, w, b: functools.partial(client_group_norm, weight=w, bias=b, norm=m)
    return None


class ClientRows:
    """Give the layers of stacked parameters their client-rows forward for the duration of a ``with``.

    Raises ``UnsupportedLayer`` at construction if a substituted tensor lies in a layer without a rule.
    """

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.layers: dict[str, tuple[nn.Module, str, object]] = {}
        for name in names:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            rule = _rule(module, attr)
            if rule is None:
                raise UnsupportedLayer(f"{name} ({type(module).__name__}.{attr})")
            self.layers[name] = (module, attr, rule)

    def __call__(self, params: TensorDict) -> _RowsPatched:
        per_layer: dict[nn.Module, dict[str, Tensor]] = {}
        rules = {}
        for name, tensor in params.items():
            module, attr, rule = self.layers[name]
            per_layer.setdefault(module, {})[attr] = tensor
            rules[module] = rule
        return _RowsPatched({m: rules[m](m, t.get("weight", m.weight), t.get("bias", m.bias)) for m, t in per_layer.items()})


class _RowsPatched:
    __slots__ = ("forwards",)

    def __init__(self, forwards: dict) -> None:
        self.forwards = forwards

    def __enter__(self) -> None:
        for module, forward in self.forwards.items():
            module.forward = forward

    def __exit__(self, *exc: object) -> None:
        for module in self.forwards:
            del module.forward
