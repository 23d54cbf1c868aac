"""The offline LoRA fixture of docs/lora.md: ``fl-lightning lora-fixture DEST``.

A tiny random GPT-2 (2 layers, width 32) and a byte-level BPE tokenizer trained on the fixture
texts, saved like hub checkpoints, and parquet files with the hub's columns of GLUE (sst2, qnli) and
SetFit/20_newsgroups, so that the production loading code runs on them unchanged (the tests use the
same builders, tests/text_fixtures.py). The command prints the settings that point each fedit_gpt2
config at the fixture.

``fl-lightning lora-fixture DEST --instruction`` writes the instruction-tuning fixture of
docs/instruction_tuning.md instead: a tiny random GPT-2 with 512 positions, a tokenizer trained on
Alpaca's prompt template and the examples (the template is a handful of tokens), and a Dolly-schema
JSONL file (instruction, context, response, category: all eight of Dolly's categories), and prints
the settings that run the fedit_dolly config on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
_WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "actor", "the", "a", "was", "is", "very"]


def _sentences(rng: np.random.Generator, labels: np.ndarray, num_classes: int) -> list[str]:
    out = []
    for y in labels:
        words = list(rng.choice(_WORDS[6:], size=rng.integers(2, 9)))
        words.insert(int(rng.integers(0, len(words) + 1)), f"w{y}" if num_classes > 2 else _WORDS[int(y) * 3])
        out.append(" ".join(words))
    return out


def write_tokenizer(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1, special_tokens=[EOS], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    tokenizer.save_pretrained(str(path))
    return path


def write_tiny_gpt2(
    path: Path, tokenizer_path: Path, n_layer: int = 2, n_embd: int = 32, seed: int = 0, n_positions: int = 128
) -> Path:
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        resid_pdrop=0.0,  # deterministic local training: identical clients give identical updates
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(str(path))  # a causal-LM checkpoint, like "gpt2" on the hub
    return path


def write_glue(path: Path, task: str, n_train: int, n_eval: int, seed: int = 0) -> dict[str, str]:
    """Parquet files with the GLUE columns of ``task`` (sst2: sentence; qnli: question, sentence)."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    files = {}
    for split, n in (("train", n_train), ("validation", n_eval)):
        labels = rng.integers(0, 2, size=n)
        if task == "sst2":
            frame = {"sentence": _sentences(rng, labels, 2)}
        elif task == "qnli":
            frame = {"question": _sentences(rng, labels, 2), "sentence": _sentences(rng, 1 - labels, 2)}
        else:
            raise ValueError(task)
        frame.update(label=labels.astype(np.int64), idx=np.arange(n, dtype=np.int32))
        files[split] = str(path / f"{task}_{split}.parquet")
        pd.DataFrame(frame).to_parquet(files[split])
    return files


def write_20news(path: Path, n_train: int, n_eval: int, seed: int = 0) -> dict[str, str]:
    """Parquet files with SetFit/20_newsgroups' columns: text, label, label_text."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    files = {}
    for split, n in (("train", n_train), ("test", n_eval)):
        labels = rng.integers(0, 20, size=n)
        texts = _sentences(rng, labels, 20)
        texts[0] = ""  # the real data has empty posts
        frame = {"text": texts, "label": labels.astype(np.int64), "label_text": [f"group{y}" for y in labels]}
        files[split] = str(path / f"20news_{split}.parquet")
        pd.DataFrame(frame).to_parquet(files[split])
    return files


def all_texts(files: list[dict[str, str]]) -> list[str]:
    import pandas as pd

    texts = []
    for split_files in files:
        for f in split_files.values():
            frame = pd.read_parquet(f)
            for col in ("sentence", "question", "text"):
                if col in frame:
                    texts.extend(frame[col].tolist())
    return texts


def write_all(root: Path) -> dict[str, object]:
    """Every fixture under ``root`` (the tests' sizes); returns their paths."""
    root.mkdir(parents=True, exist_ok=True)
    sst2 = write_glue(root, "sst2", n_train=96, n_eval=32)
    qnli = write_glue(root, "qnli", n_train=64, n_eval=24, seed=1)
    news = write_20news(root, n_train=160, n_eval=40, seed=2)
    tokenizer = write_tokenizer(root / "tokenizer", all_texts([sst2, qnli, news]))
    return {"sst2": sst2, "qnli": qnli, "20news": news, "tokenizer": tokenizer,
            "gpt2": write_tiny_gpt2(root / "gpt2", tokenizer), "cache": root / "hf_cache"}  # fmt: skip


def settings(paths: dict[str, object], task: str) -> list[str]:
    """The command-line settings that point a fedit_gpt2_<task> config at the fixture."""
    return [
        "--model.model.init_args.model_name_or_path", str(paths["gpt2"]),
        "--data.init_args.tokenizer", str(paths["tokenizer"]),
        "--data.init_args.data_files", json.dumps(paths[task]),
        "--data.init_args.cache_dir", str(paths["cache"]),
    ]  # fmt: skip


# ---- the instruction-tuning fixture (Dolly's schema) ------------------------------------------------------
DOLLY_CATEGORIES = ["brainstorming", "classification", "closed_qa", "creative_writing", "general_qa", "information_extraction", "open_qa", "summarization"]
_INSTRUCTION_WORDS = ["apple", "river", "stone", "cloud", "green", "quick", "seven", "light", "north", "music", "paper", "glass"]
INSTRUCTION_POSITIONS = 512  # the fixture model's positions: the fedit_dolly config's max_length


def _instruction_example(rng: np.random.Generator, category: str) -> tuple[str, str, str]:
    """An (instruction, context, response) whose response follows a simple rule of the instruction."""
    words = list(rng.choice(_INSTRUCTION_WORDS, size=int(rng.integers(2, 5))))
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
            instruction, context, response = _instruction_example(rng, category)
            row = {"instruction": instruction, "context": context, "response": response, "category": category, "user": f"u{i % users}"}
            f.write(json.dumps(row) + "\n")
    return path


def write_alpaca(path: Path, n: int, seed: int = 1) -> Path:
    """A JSON file (a list of records) with Alpaca's columns (instruction, input, output)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        instruction, context, response = _instruction_example(rng, DOLLY_CATEGORIES[int(rng.integers(0, 8))])
        rows.append({"instruction": instruction, "input": context, "output": response})
    path.write_text(json.dumps(rows))
    return path


def instruction_tokenizer(path: Path, dolly: Path, vocab_size: int = 400) -> Path:
    """A BPE tokenizer trained on Alpaca's two prompt templates and the examples of ``dolly``."""
    from fl_lightning.datamodules.instruction import ALPACA_TEMPLATE, ALPACA_TEMPLATE_NO_INPUT

    texts = [ALPACA_TEMPLATE, ALPACA_TEMPLATE_NO_INPUT]
    for line in dolly.read_text().splitlines():
        row = json.loads(line)
        texts += [row["instruction"], row["context"], row["response"]]
    return write_tokenizer(path, texts * 3, vocab_size=vocab_size)


def write_instruction(root: Path, n: int = 400) -> dict[str, Path]:
    """The instruction-tuning fixture under ``root``: ``dolly.jsonl``, ``tokenizer``, ``gpt2`` (512 positions)."""
    root.mkdir(parents=True, exist_ok=True)
    dolly = write_dolly(root / "dolly.jsonl", n)
    tokenizer = instruction_tokenizer(root / "tokenizer", dolly)
    gpt2 = write_tiny_gpt2(root / "gpt2", tokenizer, n_positions=INSTRUCTION_POSITIONS)
    return {"dolly": dolly, "tokenizer": tokenizer, "gpt2": gpt2, "cache": root / "hf_cache"}


def instruction_settings(paths: dict[str, Path]) -> list[str]:
    """The command-line settings that point the fedit_dolly configs at the instruction fixture
    (10 clients: the fixture's 400 examples; 10 rounds, evaluated every 5)."""
    return [
        "--model.model.init_args.model_name_or_path", str(paths["gpt2"]),
        "--data.init_args.tokenizer", str(paths["tokenizer"]),
        "--data.init_args.dataset_path", str(paths["dolly"]),
        "--data.init_args.cache_dir", str(paths["cache"]),
        "--data.init_args.num_clients", "10", "--data.init_args.test_fraction", "0.1", "--data.init_args.val_fraction", "0.1",
        "--trainer.max_steps", "10", "--trainer.val_check_interval", "5",
    ]  # fmt: skip


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (the printed command stays short)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str]) -> None:
    import argparse
    import shlex

    parser = argparse.ArgumentParser(
        prog="fl-lightning lora-fixture",
        description="Write the tiny offline GPT-2, tokenizer and GLUE/20 Newsgroups parquet files of docs/lora.md "
        "into DEST and print the settings that run each fedit_gpt2 config on them (no download).",
    )
    parser.add_argument("dest", help="output folder (created)")
    parser.add_argument(
        "--instruction", action="store_true",
        help="write the instruction-tuning fixture of docs/instruction_tuning.md instead (a GPT-2 with 512 positions, "
        "a tokenizer covering Alpaca's template, a Dolly-schema JSONL file) and print the fedit_dolly command",
    )  # fmt: skip
    ns = parser.parse_args(argv)
    from fl_lightning.core.hub import quiet_hub

    quiet_hub()
    if ns.instruction:
        paths = {k: Path(_shown(v)) for k, v in write_instruction(Path(ns.dest).resolve()).items()}
        line = ["fl-lightning", "fit", "--config", "fedit_dolly", *instruction_settings(paths)]
        print("HF_HUB_OFFLINE=1 " + " ".join(shlex.quote(a) for a in line))
        return
    paths = write_all(Path(ns.dest).resolve())
    for task, config in (("sst2", "fedit_gpt2_sst2"), ("qnli", "fedit_gpt2_qnli"), ("20news", "fedit_gpt2_20news")):
        line = ["fl-lightning", "fit", "--config", config, *settings(paths, task)]
        print("HF_HUB_OFFLINE=1 " + " ".join(shlex.quote(a) for a in line))
