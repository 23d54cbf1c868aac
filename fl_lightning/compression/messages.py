"""Compressing a whole message entry (a tensor dict): per tensor, or over the entry flattened.

``compress_entry`` is what the pipeline stages (``fl_lightning/compression/stages.py``) apply to
each entry of an upload or broadcast (``{"delta": {...}}``, SCAFFOLD's ``{"delta_c": {...}}``, ...).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.compression.base import Compressor
from fl_lightning.compression.feedback import error_feedback
from fl_lightning.core.params import TensorDict


def compress_entry(
    compressor: Compressor, entry: TensorDict, residual: TensorDict | None, generator: torch.Generator | None, flatten: bool,
    feedback: bool = True,
) -> tuple[TensorDict, TensorDict, int]:
    """(decoded entry, new residual, encoded bytes) of ``entry + residual`` (``residual=None``: zero).

    ``feedback``: the message is part of an error-feedback loop, so an unbiased compressor is used in its
    contractive form C / (1 + omega) (``fl_lightning/compression/feedback.py``); else C itself.

    Per tensor (``flatten=False``), each tensor is one compressed message, in the entry's order, all
    drawing from ``generator`` in turn; flattened, the entry's tensors are concatenated (in the
    entry's order) into one vector, compressed once and split back.
    """
    if not flatten:
        decoded, new_residual, total = {}, {}, 0
        for name, tensor in entry.items():
            sent, new = _send(compressor, tensor, None if residual is None else residual[name], generator, feedback)
            decoded[name], new_residual[name] = sent.value, new
            total += sent.nbytes
        return decoded, new_residual, total
    names = list(entry)
    flat = torch.cat([entry[n].reshape(-1) for n in names])
    flat_residual = None if residual is None else torch.cat([residual[n].reshape(-1) for n in names])
    sent, new = _send(compressor, flat, flat_residual, generator, feedback)
    return _split(sent.value, entry), _split(new, entry), sent.nbytes


def _send(compressor: Compressor, x: torch.Tensor, residual: torch.Tensor | None, generator, feedback: bool):
    if feedback:
        return error_feedback(compressor, x, residual, generator)
    sent = compressor(x, generator)
    return sent, x - sent.value


def _split(flat: Tensor, like: TensorDict) -> TensorDict:
    out, start = {}, 0
    for name, tensor in like.items():
        out[name] = flat[start : start + tensor.numel()].reshape(tensor.shape)
        start += tensor.numel()
    return out


def check_entry_sizes(compressor: Compressor, shapes: dict[str, torch.Size], flatten: bool, setting: str) -> None:
    """Raise the compressor's one-line ``ValueError`` (naming ``setting``) if it cannot encode a
    model-shaped message (every algorithm's messages are shaped like the federated tensors)."""
    if flatten:
        compressor.check_size(sum(s.numel() for s in shapes.values()), f"{setting} (the flattened message)")
        return
    for name, shape in shapes.items():
        compressor.check_size(shape.numel(), f"{setting} on {name}")
