"""Offline stand-ins for GPT-2, its tokenizer, GLUE and 20 Newsgroups, with the real schemas.

The builders live in fl_lightning/commands/lora_fixture.py (``fl-lightning lora-fixture DEST`` writes the
same files); a tiny random GPT-2 and a byte-level BPE tokenizer trained on the fixture texts are
saved like hub checkpoints; the datasets are parquet files with the hub's columns, so the
production loading code runs on them unchanged.
"""

from __future__ import annotations

from pathlib import Path

from fl_lightning.commands.lora_fixture import (  # noqa: F401  (the tests import them from here)
    _WORDS,
    EOS,
    _sentences,
    all_texts,
    write_20news,
    write_all,
    write_glue,
    write_tiny_gpt2,
    write_tokenizer,
)


class Assets:
    """Paths of the offline fixtures."""

    def __init__(self, root: Path) -> None:
        self.root = root
        paths = write_all(root)
        self.sst2, self.qnli, self.news = paths["sst2"], paths["qnli"], paths["20news"]
        self.tokenizer, self.gpt2, self.cache = paths["tokenizer"], paths["gpt2"], paths["cache"]


_SHARED: dict[str, Assets] = {}


def shared_assets(tmp_path_factory) -> Assets:
    """One set of fixtures per test process, shared by the text/LoRA test modules."""
    if "assets" not in _SHARED:
        _SHARED["assets"] = Assets(tmp_path_factory.mktemp("text_assets"))
    return _SHARED["assets"]
