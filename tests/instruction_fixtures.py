"""Offline stand-ins for Dolly and Alpaca (their columns, tiny synthetic content) and a tiny GPT-2.

The files are written like the hub's (JSONL with Dolly's columns, JSON with Alpaca's), so the
production loading code runs on them unchanged. Responses follow simple rules of the instruction
(repeat a word, name a category, reverse a list) so that a few rounds measurably lower the loss.
"""

from __future__ import annotations

from pathlib import Path

from fl_lightning.commands.lora_fixture import (  # noqa: F401  (the tests import them from here)
    DOLLY_CATEGORIES,
    instruction_tokenizer,
    write_alpaca,
    write_dolly,
    write_tiny_gpt2,
)


class InstructionAssets:
    """Paths of the offline instruction-tuning fixtures (data, tokenizer, tiny GPT-2)."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.dolly = write_dolly(root / "dolly.jsonl", 160)
        self.alpaca = write_alpaca(root / "alpaca.json", 80)
        self.tokenizer = instruction_tokenizer(root / "tokenizer", self.dolly)
        self.gpt2 = write_tiny_gpt2(root / "gpt2", self.tokenizer, n_embd=32)


_SHARED: dict[str, InstructionAssets] = {}


def shared_instruction_assets(tmp_path_factory) -> InstructionAssets:
    if "assets" not in _SHARED:
        _SHARED["assets"] = InstructionAssets(tmp_path_factory.mktemp("instruction_assets"))
    return _SHARED["assets"]
