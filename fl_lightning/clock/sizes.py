"""A client upload's size in bytes before it is trained, for the clock's timing of tasks not yet run."""

from __future__ import annotations

from typing import Any

import torch

from fl_lightning.core.metrics import payload_bytes
from fl_lightning.core.params import TensorDict
from fl_lightning.pipeline.messages import upload_like


def nominal_upload_bytes(algorithm: Any, x: TensorDict, compression: Any = None) -> int:
    """The encoded size of an upload shaped like the algorithm's (``upload_like``), through the uplink
    compressor if any. The built-in compressors' sizes depend only on the tensors' shapes, so this is
    every client's actual upload size (tests/test_clock.py checks it against the pipeline's)."""
    like = upload_like(algorithm, x)
    if compression is None or compression.up is None:
        return payload_bytes(like)
    from fl_lightning.compression.messages import compress_entry

    generator = torch.Generator(device=next(iter(x.values())).device).manual_seed(0)
    total = 0
    for td in like.values():
        ones = {k: torch.ones_like(v) for k, v in td.items()}
        total += compress_entry(compression.up, ones, None, generator, compression.flatten, compression.feedback_up)[2]
    return total
