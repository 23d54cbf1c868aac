"""Federated LoRA aggregation methods (docs/algorithms.md, section 28): ``FederatedModule(lora_aggregation=...)``.

One file per method; ``server`` applies one to a model that declares ``lora_layers()``. Imports ``core`` only."""

from __future__ import annotations

from .base import LayerRound, LayerUpdate, LoRAAggregation, mean_product, pad_a, pad_b
from .exact_residual import ExactResidual
from .factors import Factors
from .methods import METHODS, resolve
from .server import LoRAServer, lora_server
from .share_a import ShareA
from .stacked import Stacked
from .svd import SVD
from .zero_pad import ZeroPad

__all__ = [
    "METHODS", "ExactResidual", "Factors", "LayerRound", "LayerUpdate", "LoRAAggregation", "LoRAServer",
    "SVD", "ShareA", "Stacked", "ZeroPad", "lora_server", "mean_product", "pad_a", "pad_b", "resolve",
]  # fmt: skip
