"""The methods by setting name, and ``resolve`` of ``model.lora_aggregation``."""

from __future__ import annotations

from .base import LoRAAggregation
from .exact_residual import ExactResidual
from .factors import Factors
from .share_a import ShareA
from .stacked import Stacked
from .svd import SVD
from .zero_pad import ZeroPad

METHODS = {m.name: m for m in (Factors, Stacked, ExactResidual, SVD, ZeroPad, ShareA)}


def resolve(lora_aggregation: str | LoRAAggregation | None) -> LoRAAggregation | None:
    """The method named by ``lora_aggregation`` (or the object itself); ``None``: none (FedIT's factors, nothing runs)."""
    if lora_aggregation is None or isinstance(lora_aggregation, LoRAAggregation):
        return lora_aggregation
    if lora_aggregation not in METHODS:
        raise ValueError(f"model.lora_aggregation must be one of {', '.join(METHODS)}, got {lora_aggregation!r}")
    return METHODS[lora_aggregation]()
