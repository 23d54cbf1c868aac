"""What a model with LoRA adapters declares about them (``lora_layers()``), for the aggregation methods
of ``fl_lightning.lora`` (docs/algorithms.md, section 28)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterLayer:
    """One adapted layer of a model (names relative to it): its factors, its frozen weight, its scaling."""

    a: str  # A [r, in]
    b: str  # B [out, r]
    base: str  # the frozen weight W0
    scaling: float  # alpha / r: the layer computes with W0 + scaling * B A
    fan_in_fan_out: bool  # W0 stored [in, out] (GPT-2's Conv1D): the fold is transposed
