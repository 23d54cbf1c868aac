"""Communication compression: compressors (tensor -> decoded tensor + encoded bytes) and error feedback.

docs/algorithms.md, section 21 (encodings and bits per coordinate); docs/compression.md (the study).
"""

from fl_lightning.compression.base import Compressor, Encoded, Identity
from fl_lightning.compression.feedback import error_feedback
from fl_lightning.compression.quantize import QSGD, Cast, Int8, ScaledSign
from fl_lightning.compression.sparsify import RandomK, TopK, sparse_bytes

__all__ = ["QSGD", "Cast", "Compressor", "Encoded", "Identity", "Int8", "RandomK", "ScaledSign", "TopK", "error_feedback", "sparse_bytes"]
