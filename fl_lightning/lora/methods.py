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


def resolve(setting: str | LoRAAggregation | None) -> LoRAAggregation | None:
    """The method named by ``setting`` (or the object itself); ``None``: none (FedIT's factors, nothing runs)."""
    if setting is None or isinstance(setting, LoRAAggregation):
        return setting
    if setting not in METHODS:
        raise ValueError(f"model.lora_aggregation must be one of {', '.join(METHODS)}, got {setting!r}")
    return METHODS[setting]()
