"""Federated LoRA aggregation methods (docs/algorithms.md, section 28): ``FederatedModule(lora_aggregation=...)``."""

from __future__ import annotations

from .base import LayerRound, LayerUpdate, LoRAAggregation, mean_product, pad_a, pad_b
from .exact_residual import ExactResidual
from .factors import Factors
from .server import AdapterLayer, LoRAServer, lora_server
from .share_a import ShareA
from .stacked import Stacked
from .svd import SVD
from .zero_pad import ZeroPad

METHODS = {m.name: m for m in (Factors, Stacked, ExactResidual, SVD, ZeroPad, ShareA)}

__all__ = [
    "METHODS", "AdapterLayer", "ExactResidual", "Factors", "LayerRound", "LayerUpdate", "LoRAAggregation", "LoRAServer",
    "SVD", "ShareA", "Stacked", "ZeroPad", "lora_server", "mean_product", "pad_a", "pad_b", "resolve",
]  # fmt: skip


def resolve(setting: str | LoRAAggregation | None) -> LoRAAggregation | None:
    """The method named by ``setting`` (or the object itself); ``None``: none (FedIT's factors, nothing runs)."""
    if setting is None or isinstance(setting, LoRAAggregation):
        return setting
    if setting not in METHODS:
        raise ValueError(f"model.lora_aggregation must be one of {', '.join(METHODS)}, got {setting!r}")
    return METHODS[setting]()
