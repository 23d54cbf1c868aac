"""Offline stand-ins for Dolly and Alpaca (their columns, tiny synthetic content) and a tiny GPT-2.

The files are written like the hub's (JSONL with Dolly's columns, JSON with Alpaca's), so the
production loading code runs on them unchanged. Responses follow simple rules of the instruction
(repeat a word, name a category, reverse a list) so that a few rounds measurably lower the loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.text_fixtures import write_tiny_gpt2, write_tokenizer

DOLLY_CATEGORIES = ["brainstorming", "classification", "closed_qa", "creative_writing", "general_qa", "information_extraction", "open_qa", "summarization"]
_WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "seven", "light", "north", "music", "paper", "glass"]


def _example(rng: np.random.Generator, category: str) -> tuple[str, str, str]:
    words = list(rng.choice(_WORDS, size=int(rng.integers(2, 5))))
    kind = DOLLY_CATEGORIES.index(category) % 4
    if kind == 0:
        return f"Repeat the word {words[0]} twice.", "", f"{words[0]} {words[0]}"
    if kind == 1:
        return "Which category is this?", " ".join(words), category.replace("_", " ")
    if kind == 2:
        return "Reverse the list.", ", ".join(words), ", ".join(reversed(words))
    return f"Write about {words[0]}.", "", f"The {words[0]} is {words[-1]} and {words[0]}."


def write_dolly(path: Path, n: int, seed: int = 0, users: int = 6) -> Path:
    """A JSONL file with Dolly's columns (instruction, context, response, category) and a ``user`` column."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            category = DOLLY_CATEGORIES[int(rng.integers(0, len(DOLLY_CATEGORIES)))]
            instruction, context, response = _example(rng, category)
            row = {"instruction": instruction, "context": context, "response": response, "category": category, "user": f"u{i % users}"}
            f.write(json.dumps(row) + "\n")
    return path


def write_alpaca(path: Path, n: int, seed: int = 1) -> Path:
    """A JSON file (a list of records) with Alpaca's columns (instruction, input, output)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        instruction, context, response = _example(rng, DOLLY_CATEGORIES[int(rng.integers(0, 8))])
        rows.append({"instruction": instruction, "input": context, "output": response})
    path.write_text(json.dumps(rows))
    return path


class InstructionAssets:
    """Paths of the offline instruction-tuning fixtures (data, tokenizer, tiny GPT-2)."""

    def __init__(self, root: Path) -> None:
        from datamodules.instruction import ALPACA_TEMPLATE, ALPACA_TEMPLATE_NO_INPUT

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.dolly = write_dolly(root / "dolly.jsonl", 160)
        self.alpaca = write_alpaca(root / "alpaca.json", 80)
        texts = [ALPACA_TEMPLATE, ALPACA_TEMPLATE_NO_INPUT]
        for line in self.dolly.read_text().splitlines():
            row = json.loads(line)
            texts += [row["instruction"], row["context"], row["response"]]
        self.tokenizer = write_tokenizer(root / "tokenizer", texts * 3, vocab_size=400)
        self.gpt2 = write_tiny_gpt2(root / "gpt2", self.tokenizer, n_embd=32)


_SHARED: dict[str, InstructionAssets] = {}


def shared_instruction_assets(tmp_path_factory) -> InstructionAssets:
    if "assets" not in _SHARED:
        _SHARED["assets"] = InstructionAssets(tmp_path_factory.mktemp("instruction_assets"))
    return _SHARED["assets"]
