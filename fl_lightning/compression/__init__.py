"""Communication compression: compressors (tensor -> decoded tensor + encoded bytes), error feedback,
and the message-pipeline stages that apply them (``Compression``, ``--model.compression.*``).

docs/algorithms.md, section 24 (encodings and bits per coordinate); docs/compression.md (the study).

May import: core, pipeline.
"""

from fl_lightning.compression.base import Compressor, Encoded, Identity
from fl_lightning.compression.feedback import error_feedback
from fl_lightning.compression.quantize import QSGD, Cast, Int8, ScaledSign
from fl_lightning.compression.sparsify import RandomK, TopK, sparse_bytes

__all__ = ["QSGD", "Cast", "Compression", "Compressor", "Encoded", "Identity", "Int8", "RandomK", "ScaledSign", "TopK", "error_feedback", "sparse_bytes"]


def __getattr__(name: str):
    if name == "Compression":  # the pipeline stages import the engine; the compressors alone do not
        from fl_lightning.compression.stages import Compression

        return Compression
    raise AttributeError(name)
