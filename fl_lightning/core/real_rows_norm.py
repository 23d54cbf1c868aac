"""Batch normalisation over a batch's real rows: BatchNorm without running statistics on masked stacking's padded
batches (docs/algorithms.md, (29.4)).

A padded batch (``fl_lightning.core.client_data.IGNORE_TARGET`` targets on its padded rows) trains a client as its
real rows alone would, provided nothing mixes the rows: cross-entropy ignores the padded rows, but a BatchNorm layer's
batch statistics would average them in. While ``real_rows_batch_norm`` is active, each such layer normalises with the
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


@contextmanager
def real_rows_batch_norm(layers: Sequence[nn.modules.batchnorm._BatchNorm], target: Tensor) -> Iterator[None]:
    """Within the block, ``layers`` normalise with the statistics of the rows of ``target`` that are not padding."""
    real = real_rows(target)
    for layer in layers:
        layer.forward = lambda x, layer=layer: masked_batch_norm(x, real, layer.weight, layer.bias, layer.eps)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
