"""Compression's declarations as a round stage (``model.compression``; docs/compression.md): the shapes it
can compress and what it composes with. Its compressors run as message stages (the ``messages`` stage)."""

from __future__ import annotations

from typing import Any

from fl_lightning.compression.stages import Compression
from fl_lightning.rounds.stage import AGGREGATE, RoundStage, refusal


class CompressionStage(RoundStage):
    name = "compression"
    order = AGGREGATE + 5  # declarations only: no hook of the round
    setting = "model.compression"
    conflicts = {"privacy": "an uplink compressor that can grow an upload's norm, or error feedback's residual, escapes the clip norm"}

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.compression)

    def __init__(self, compression: Compression, shapes: dict[str, Any]) -> None:
        self.compression = compression
        compression.check_shapes(shapes)
        compression.warn_feedback(shapes)  # an explicit error_feedback_up: true with an unbiased compressor

    def conflict_with(self, other: RoundStage) -> str | None:
        if other.name == "privacy":
            return refusal(self.compression.check_with_privacy)
        return None
