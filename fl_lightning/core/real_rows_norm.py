"""Batch normalisation over a batch's real rows: BatchNorm without running statistics on masked stacking's padded
batches (docs/algorithms.md, (29.4)).

A padded batch (``fl_lightning.core.client_data.IGNORE_TARGET`` targets on its padded rows) trains a client as its
real rows alone would, provided nothing mixes the rows: cross-entropy ignores the padded rows, but a BatchNorm layer's
batch statistics would average them in. While ``RealRowsNorm`` is installed and given a mask, each such layer normalises with the
mean and (biased) variance of the real rows only, per channel over the rows and spatial positions, which is
``F.batch_norm(x[real], training=True)`` on the real rows; the padded rows' outputs are computed but enter no loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from fl_lightning.core.client_data import IGNORE_TARGET


def batch_statistics_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that normalise with batch statistics (no running statistics)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.track_running_stats]


def real_rows(target: Tensor) -> Tensor:
    """Bool ``[B]``: the rows of a batch that are not padding (a row of token targets is padding when all are)."""
    return target.ne(IGNORE_TARGET) if target.dim() == 1 else target.reshape(target.shape[0], -1).ne(IGNORE_TARGET).any(1)


def masked_batch_norm(x: Tensor, real: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """(29.4): ``x`` ``[B, C, *spatial]`` normalised per channel by the mean and biased variance of its ``real`` rows."""
    shape = (-1, *[1] * (x.dim() - 1))
    keep = real.to(x.dtype).reshape(shape)
    dims = [0, *range(2, x.dim())]
    count = (keep.sum() * (x[0, 0].numel())).clamp(min=1)
    mean = (x * keep).sum(dims, keepdim=True) / count
    centred = x - mean
    var = (centred.square() * keep).sum(dims, keepdim=True) / count
    out = centred * torch.rsqrt(var + eps)
    channel = (1, -1, *[1] * (x.dim() - 2))
    if weight is not None:
        out = out * weight.reshape(channel)
    if bias is not None:
        out = out + bias.reshape(channel)
    return out


class RealRowsNorm:
    """(29.4) for a model's batch-statistics BatchNorm ``layers``: while ``installed`` (a forward hook on each layer,
    whose output replaces the layer's) and ``real`` holds a batch's real-row mask, the layers normalise over those rows;
    with ``real`` None the hooks leave the layers' outputs as they are. The hooks are installed outside any compiled
    program (``torch.compile`` traces hooks, not their registration) and ``real`` is set where the batch's targets are
    known, inside ``vmap`` per client."""

    def __init__(self, layers: Sequence[nn.modules.batchnorm._BatchNorm]) -> None:
        self.layers, self.real, self.installed = list(layers), None, False

    @contextmanager
    def install(self) -> Iterator[None]:
        handles = [layer.register_forward_hook(self._output) for layer in self.layers]
        self.installed = True
        try:
            yield
        finally:
            self.installed = False
            for handle in handles:
                handle.remove()

    def _output(self, layer: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        if self.real is None:
            return None
        return masked_batch_norm(args[0], self.real, layer.weight, layer.bias, layer.eps)
