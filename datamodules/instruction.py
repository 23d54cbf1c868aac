"""Instruction data (Alpaca and Dolly schemas) for federated instruction tuning of a causal LM.

Each example becomes ``prompt + response + <eos>`` tokens: the prompt is the template filled with
the instruction and its input (Dolly's ``context``), the response is the reference answer. The
batch's ``labels`` mask the prompt (and padding) with ``IGNORE_INDEX``, so the loss is taken on the
response only (``models.LoRACausalLM``).

Data come through the ``datasets`` library, from a hub id or local JSON/JSONL/parquet/CSV files,
through the same code path. The schema is recognised by its columns:

- Alpaca: ``instruction``, ``input``, ``output``;
- Dolly: ``instruction``, ``context``, ``response``, ``category``.

``category`` (or the column named by ``label_column``) drives label-skew partitions, so
``Dirichlet(alpha)`` is task skew as in FedIT's heterogeneous setting; other columns named in
``natural_columns`` can drive ``NaturalPartition(column=...)``.

Truncation (stated): sequences longer than ``max_length`` tokens are cut at the end (the end of a
long response is dropped, its final ``<eos>`` too); an example whose prompt alone leaves no
response token within ``max_length`` is dropped, and the number dropped is logged. No packing.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .federated import FederatedDataModule
from .partition import Partitioner
from .sources import DataSource
from .text import _FILE_BUILDERS, TokenSequences, _tokenizer_digest, load_tokenizer
from fl_lightning.core.participation import Participation

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
_CACHE_VERSION = "1"

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
TEMPLATES = {"alpaca": (ALPACA_TEMPLATE, ALPACA_TEMPLATE_NO_INPUT), "plain": ("{instruction}\n{input}\n", "{instruction}\n")}

SCHEMAS = {  # schema -> (instruction, input, response) columns
    "alpaca": ("instruction", "input", "output"),
    "dolly": ("instruction", "context", "response"),
}


def detect_schema(columns: list[str]) -> str:
    """The schema whose columns ``columns`` has (one line naming what is missing otherwise)."""
    for name, needed in SCHEMAS.items():
        if set(needed) <= set(columns):
            return name
    raise ValueError(
        f"instruction data needs the Alpaca columns {list(SCHEMAS['alpaca'])} or the Dolly columns "
        f"{list(SCHEMAS['dolly'])}; found {columns}"
    )


def format_prompt(template: str | tuple[str, str], instruction: str, context: str | None) -> str:
    """The prompt of one example: ``template`` (or its no-input variant when there is no input)."""
    with_input, without_input = TEMPLATES[template] if isinstance(template, str) else template
    context = (context or "").strip()
    return with_input.format(instruction=instruction, input=context) if context else without_input.format(instruction=instruction)


class InstructionSequences(Dataset):
    """Token sequences ``prompt + response`` stored flat, with each prompt's length.

    ``gather(index)`` builds ``{"input_ids", "attention_mask", "labels"}`` of any index tensor in a
    few vectorised ops: right-padded input ids, and ``labels[t]`` = the token at t + 1 when it is a
    response token, else ``IGNORE_INDEX`` (``labels`` is one shorter than ``input_ids``).
    ``labels`` (the attribute) holds each example's category code, for partitions and per-category
    evaluation.
    """

    def __init__(self, ids: Tensor, offsets: Tensor, prompt_lengths: Tensor, labels: Tensor, pad_id: int = 0) -> None:
        self.ids, self.offsets, self.prompt_lengths, self.labels, self.pad_id = ids, offsets, prompt_lengths, labels, pad_id
        self._lengths = offsets[1:] - offsets[:-1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        """Example ``i`` unpadded: ``{"input_ids": [L], "labels": [L - 1]}`` (``InstructionCollate`` pads)."""
        batch = self.gather(torch.tensor([i]))
        return {"input_ids": batch["input_ids"][0], "labels": batch["labels"][0]}

    def lengths(self) -> Tensor:
        return self._lengths

    def tokens(self, i: int) -> tuple[Tensor, Tensor]:
        """``(prompt ids, response ids)`` of example ``i``."""
        start, end, cut = int(self.offsets[i]), int(self.offsets[i + 1]), int(self.prompt_lengths[i])
        return self.ids[start : start + cut], self.ids[start + cut : end]

    def subset(self, order: Tensor) -> InstructionSequences:
        pieces = [self.ids[self.offsets[i] : self.offsets[i + 1]] for i in order.tolist()]
        offsets = torch.zeros(len(pieces) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor([len(p) for p in pieces], dtype=torch.int64), 0)
        ids = torch.cat(pieces) if pieces else self.ids[:0]
        return InstructionSequences(ids, offsets, self.prompt_lengths[order], self.labels[order], self.pad_id)

    def gather(self, index: Tensor, width: int | None = None) -> dict[str, Tensor]:
        lengths = self._lengths[index]
        if width is None:
            width = int(lengths.max()) if index.numel() else 0
        positions = torch.arange(width)
        mask = positions < lengths.unsqueeze(-1)
        flat = (self.offsets[:-1][index].unsqueeze(-1) + positions).clamp_(max=max(len(self.ids) - 1, 0))
        response = mask & (positions >= self.prompt_lengths[index].unsqueeze(-1))
        device = self.ids.device
        mask, flat, response = (t.to(device, non_blocking=True) for t in (mask, flat, response))
        input_ids = torch.where(mask, self.ids[flat], self.pad_id)
        labels = torch.where(response[..., 1:], input_ids[..., 1:], IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}

    gather_steps = TokenSequences.gather_steps  # the same per-step widths over ``_lengths`` and ``gather``

    def to(self, device: torch.device) -> InstructionSequences:
        return InstructionSequences(self.ids.to(device), self.offsets, self.prompt_lengths, self.labels, self.pad_id)


class InstructionCollate:
    """``[{"input_ids", "labels"}, ...]`` -> the right-padded batch ``gather`` would build."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(items), width), dtype=torch.int64)
        labels = torch.full((len(items), width - 1), IGNORE_INDEX, dtype=torch.int64)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            input_ids[row, :n], mask[row, :n], labels[row, : n - 1] = item["input_ids"], 1, item["labels"]
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class InstructionDataModule(FederatedDataModule):
    """Instruction-tuning data (Alpaca or Dolly schema) partitioned among clients.

    Args:
        dataset_path: hub id (e.g. ``databricks/databricks-dolly-15k``, ``tatsu-lab/alpaca``) or a
            local file (``.json``/``.jsonl``/``.parquet``/``.csv``) or ``save_to_disk`` folder.
        data_files: ``{"train": path, "test": path}`` of local files instead (a held-out split of
            your own); without a ``test`` file, ``test_fraction`` of the examples are held out.
        tokenizer: hub id or local directory of the tokenizer (the base model's).
        template: ``"alpaca"`` (Alpaca's prompt, the default), ``"plain"``, or a pair of format
            strings ``[with_input, without_input]`` using ``{instruction}`` and ``{input}``.
        max_length: tokens kept per example, >= 8 (see the module docstring for truncation).
        label_column: the column whose values drive label-skew partitions and per-category
            evaluation (Dolly: ``category``); examples without it all get category 0.
        natural_columns: further columns offered to ``NaturalPartition(column=...)``.
        test_fraction: share of the examples held out as the test set when no test split is given.
        max_examples: use at most this many training examples (the first ones; None: all).
        cache_dir, trust_remote_code: as in ``TextDataModule``.
        Other arguments as in ``FederatedDataModule``.
    """

    def __init__(
        self,
        dataset_path: str | None = None,
        data_files: dict[str, str] | None = None,
        tokenizer: str = "gpt2",
        template: str | list[str] = "alpaca",
        max_length: int = 256,
        label_column: str = "category",
        natural_columns: list[str] | None = None,
        test_fraction: float = 0.05,
        max_examples: int | None = None,
        cache_dir: str | None = None,
        trust_remote_code: bool = False,
        num_clients: int = 20,
        partition: Partitioner | None = None,
        participation: Participation | None = None,
        holdout_fraction: float = 0.0,
        val_fraction: float = 0.0,
        eval_batch_size: int = 16,
        seed: int | None = None,
    ) -> None:
        if (dataset_path is None) == (data_files is None):
            raise ValueError("InstructionDataModule needs exactly one of data.init_args.dataset_path and data.init_args.data_files")
        if data_files is not None:
            if "train" not in data_files:
                raise ValueError(f"data_files must have a 'train' file; got splits {sorted(data_files)}")
            suffixes = {Path(p).suffix for p in data_files.values()}
            if len(suffixes) != 1 or next(iter(suffixes)) not in _FILE_BUILDERS:
                raise ValueError(f"data_files must all be one of {sorted(_FILE_BUILDERS)}, got {sorted(suffixes)}")
        if isinstance(template, str) and template not in TEMPLATES:
            raise ValueError(f"template must be one of {sorted(TEMPLATES)} or a pair of format strings, got {template!r}")
        if not isinstance(template, str) and (len(template) != 2 or "{instruction}" not in template[0]):
            raise ValueError("template must be a pair [with_input, without_input] of format strings using {instruction}")
        if max_length < 8:
            raise ValueError(f"max_length must be >= 8, got {max_length}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1 or null, got {max_examples}")
        super().__init__(
            dataset="instruction", num_clients=num_clients, partition=partition, participation=participation,
            holdout_fraction=holdout_fraction, eval_batch_size=eval_batch_size, seed=seed, val_fraction=val_fraction,
        )  # fmt: skip
        self.dataset_path = dataset_path
        self.data_files = dict(data_files) if data_files is not None else None
        self.tokenizer_name, self.template, self.max_length = tokenizer, template if isinstance(template, str) else tuple(template), max_length
        self.label_column, self.natural_columns = label_column, list(natural_columns or [])
        self.test_fraction, self.max_examples = test_fraction, max_examples
        self.cache_dir, self.trust_remote_code = cache_dir, trust_remote_code
        self.categories: list[str] = []
        self.dropped_by_category: dict[str, tuple[int, int]] = {}  # category -> (dropped, total) when more than half is dropped
        self.longest = 0  # the longest kept sequence in tokens (prompt + response + <eos>, after truncation)
        self.test_examples: list[dict[str, Any]] = []  # the raw held-out examples (prompts and references for generation)

    def held_out(self) -> InstructionSequences:
        """The held-out (test) sequences; their ``labels`` are category codes."""
        self.setup()
        return self.source.test

    def tokenizer(self):
        """The tokenizer (with its pad token), loaded once."""
        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name, self.trust_remote_code)
        return self._tokenizer

    # ---- loading -----------------------------------------------------------------------
    def _load_raw(self):
        from datasets import DatasetDict, load_dataset, load_from_disk

        from fl_lightning.core.hub import hub_error

        try:
            if self.data_files is not None:
                builder = _FILE_BUILDERS[Path(next(iter(self.data_files.values()))).suffix]
                raw = load_dataset(builder, data_files=self.data_files, cache_dir=self.cache_dir)
            elif Path(self.dataset_path).suffix in _FILE_BUILDERS and Path(self.dataset_path).is_file():
                builder = _FILE_BUILDERS[Path(self.dataset_path).suffix]
                raw = load_dataset(builder, data_files={"train": self.dataset_path}, cache_dir=self.cache_dir)
            elif Path(self.dataset_path).is_dir() and (Path(self.dataset_path) / "dataset_dict.json").exists():
                raw = load_from_disk(self.dataset_path)
            else:
                raw = load_dataset(self.dataset_path, cache_dir=self.cache_dir)
        except (OSError, FileNotFoundError) as error:
            setting = "data.init_args.data_files" if self.data_files is not None else "data.init_args.dataset_path"
            raise hub_error(
                setting, self.data_files or self.dataset_path, "instruction dataset", error,
                "a local JSON/JSONL/parquet file with the Alpaca or Dolly columns",
            ) from error
        if not isinstance(raw, DatasetDict) or "train" not in raw:
            raise ValueError(f"instruction data must have a 'train' split; found {list(raw)}")
        train = raw["train"]
        if self.max_examples is not None:
            train = train.select(range(min(self.max_examples, len(train))))
        if "test" in raw:
            return train, raw["test"]
        split = train.train_test_split(test_size=self.test_fraction, seed=self.seed, shuffle=True)
        return split["train"], split["test"]

    def _tokenize(self, ds, tokenizer, digest: str, schema: str) -> tuple[InstructionSequences, Tensor]:
        """The examples' token sequences, and the indices of those that keep a response token."""
        instruction, context, response = SCHEMAS[schema]
        template, max_length = self.template, self.max_length
        eos = tokenizer.eos_token_id

        def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            prompts = [format_prompt(template, i or "", c) for i, c in zip(batch[instruction], batch[context])]
            prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer([r or "" for r in batch[response]], add_special_tokens=False)["input_ids"]
            ids, cuts = [], []
            for p, a in zip(prompt_ids, answer_ids):
                ids.append((p + a + [eos])[:max_length])
                cuts.append(len(p))
            return {"input_ids": ids, "prompt_length": cuts}

        key = "|".join([_CACHE_VERSION, ds._fingerprint, digest, str(max_length), repr(template), schema])
        tokenized = ds.map(
            encode, batched=True, remove_columns=ds.column_names,
            new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32], desc="tokenizing instructions",
        )  # fmt: skip
        if getattr(tokenized, "_indices", None) is not None:
            tokenized = tokenized.flatten_indices()
        column = tokenized.data.column("input_ids").combine_chunks()
        offsets = torch.from_numpy(column.offsets.to_numpy().astype("int64"))
        ids = torch.from_numpy(column.flatten().to_numpy().astype("int64"))
        cuts = torch.from_numpy(tokenized.data.column("prompt_length").to_numpy().astype("int64"))
        codes = self._category_codes(ds)
        data = InstructionSequences(ids, offsets - offsets[0], cuts, codes)
        keep = torch.nonzero(data.lengths() > cuts).flatten()  # at least one response token fits
        self._all_codes.append(codes)
        self._all_prompts.append(cuts)
        return (data.subset(keep) if len(keep) < len(data) else data), keep

    def _check_dropped(self, kept_train: Tensor, kept_test: Tensor) -> None:
        """The examples ``max_length`` drops (no response token fits), counted per category: one warning for the
        total, one per category that loses more than half of its examples; every example dropped (in the train or
        the test split) is refused in one line."""
        setting = f"data.init_args.max_length={self.max_length}"
        if len(kept_train) == 0 or len(kept_test) == 0:
            shortest = int(torch.cat(self._all_prompts).min()) if sum(len(p) for p in self._all_prompts) else 0
            split = "any example" if len(kept_train) == len(kept_test) == 0 else f"any {'training' if len(kept_train) == 0 else 'test'} example"
            raise ValueError(
                f"{setting} leaves no response token in {split}: the shortest prompt (template + instruction + input) needs "
                f"{shortest} tokens; set data.init_args.max_length above {shortest} (with a model of that many positions) "
                "or a shorter data.init_args.template (e.g. plain)"
            )
        self.dropped_by_category: dict[str, tuple[int, int]] = {}
        if not any(self.dropped):
            return
        log.warning("%s leaves no response token in %d training and %d test examples: they are dropped", setting, *self.dropped)
        codes = torch.cat(self._all_codes)
        kept = torch.zeros(len(codes), dtype=torch.bool)
        kept[kept_train] = True
        kept[len(self._all_codes[0]) + kept_test] = True
        names = self.categories or ["all"]
        for code in sorted(set(codes.tolist())):
            total = int((codes == code).sum())
            lost = total - int(kept[codes == code].sum())
            if 2 * lost <= total:
                continue
            self.dropped_by_category[names[code]] = (lost, total)
            if lost == total:
                log.warning(
                    "category %s loses all its %d examples to %s (each needs more tokens): it is left out of training and "
                    "of every metric; raise data.init_args.max_length (at most the model's positions)", names[code], total, setting,
                )  # fmt: skip
            else:
                log.warning(
                    "category %s loses %d of its %d examples (more than half) to %s: its metrics cover the short ones only; "
                    "raise data.init_args.max_length (at most the model's positions)", names[code], lost, total, setting,
                )  # fmt: skip

    def _category_codes(self, ds) -> Tensor:
        if self.label_column not in ds.column_names:
            return torch.zeros(len(ds), dtype=torch.int64)
        values = [str(v) for v in ds[self.label_column]]
        if not self.categories:
            self.categories = sorted(set(values))
        lookup = {c: i for i, c in enumerate(self.categories)}
        unknown = sorted(set(values) - set(lookup))
        if unknown:  # a test category never seen in training: one more code
            self.categories += unknown
            lookup = {c: i for i, c in enumerate(self.categories)}
        return torch.tensor([lookup[v] for v in values], dtype=torch.int64)

    def _natural(self, ds) -> dict[str, Tensor]:
        columns = {}
        for name in self.natural_columns:
            if name not in ds.column_names:
                raise ValueError(f"natural_columns names {name!r}, which the data lacks; columns: {ds.column_names}")
            values = [str(v) for v in ds[name]]
            lookup = {c: i for i, c in enumerate(sorted(set(values)))}
            columns[name] = torch.tensor([lookup[v] for v in values], dtype=torch.int64)
        return columns

    def build_source(self) -> DataSource:
        tokenizer = self.tokenizer()
        digest = _tokenizer_digest(tokenizer)
        train_raw, test_raw = self._load_raw()
        self.schema = detect_schema(train_raw.column_names)
        self.categories, self._all_codes, self._all_prompts = [], [], []
        train, kept_train = self._tokenize(train_raw, tokenizer, digest, self.schema)
        test, kept_test = self._tokenize(test_raw, tokenizer, digest, self.schema)
        self.dropped = (len(train_raw) - len(kept_train), len(test_raw) - len(kept_test))
        self._check_dropped(kept_train, kept_test)
        self.longest = int(max(int(train.lengths().max()) if len(train) else 0, int(test.lengths().max()) if len(test) else 0))
        instruction, context, response = SCHEMAS[self.schema]
        rows = test_raw.select(kept_test.tolist())
        self.test_examples = [
            {"prompt": format_prompt(self.template, r[instruction] or "", r[context]), "reference": r[response] or "",
             "category": self.categories[code] if self.categories else ""}
            for r, code in zip(rows, test.labels.tolist())
        ]  # fmt: skip
        train.pad_id = test.pad_id = tokenizer.pad_token_id
        natural = {k: v[kept_train] for k, v in self._natural(train_raw).items()}
        return DataSource(
            train, test, train.labels, max(len(self.categories), 1),
            collate_fn=InstructionCollate(tokenizer.pad_token_id), columns=natural,
        )  # fmt: skip
