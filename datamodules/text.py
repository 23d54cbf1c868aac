"""Text classification: GLUE tasks and 20 Newsgroups, tokenized once, padded per batch.

Data come through the ``datasets`` library: the hub dataset by default, or local
files with the same columns (``data_files``, e.g. parquet) through the same code
path. Tokenization is a ``Dataset.map`` with a fingerprint derived from the data,
the tokenizer and the settings, so a second run reads it from the datasets cache.
Token ids are then held as one flat tensor plus offsets (no per-sample Python
objects), and each batch is padded to its longest sequence only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from .federated import FederatedDataModule
from .partition import Partitioner
from .sources import DataSource
from fl_lightning.core.participation import Participation

_CACHE_VERSION = "1"


@dataclass(frozen=True)
class TextTask:
    """Where a task's data live and which columns hold its text."""

    path: str  # hub dataset id
    name: str | None  # hub configuration
    fields: tuple[str, ...]  # one text column, or two for sentence pairs
    num_classes: int
    eval_split: str  # labelled split used as the global test set (GLUE's test labels are hidden)
    train_split: str = "train"


TASKS: dict[str, TextTask] = {
    "sst2": TextTask("nyu-mll/glue", "sst2", ("sentence",), 2, "validation"),
    "cola": TextTask("nyu-mll/glue", "cola", ("sentence",), 2, "validation"),
    "mrpc": TextTask("nyu-mll/glue", "mrpc", ("sentence1", "sentence2"), 2, "validation"),
    "qqp": TextTask("nyu-mll/glue", "qqp", ("question1", "question2"), 2, "validation"),
    "qnli": TextTask("nyu-mll/glue", "qnli", ("question", "sentence"), 2, "validation"),
    "rte": TextTask("nyu-mll/glue", "rte", ("sentence1", "sentence2"), 2, "validation"),
    "mnli": TextTask("nyu-mll/glue", "mnli", ("premise", "hypothesis"), 3, "validation_matched"),
    "20news": TextTask("SetFit/20_newsgroups", None, ("text",), 20, "test"),
}

_FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}


class TokenSequences(Dataset):
    """Variable-length token sequences stored flat: sample i is ``ids[offsets[i]:offsets[i+1]]``.

    ``gather`` builds the right-padded batch of any index tensor in a few vectorised ops (the
    batch ``PadCollate`` makes from the same samples), so clients' batches can be stacked.
    """

    def __init__(self, ids: Tensor, offsets: Tensor, labels: Tensor, pad_id: int = 0) -> None:
        self.ids, self.offsets, self.labels, self.pad_id = ids, offsets, labels, pad_id
        self._lengths = offsets[1:] - offsets[:-1]  # on the CPU: batch shapes are decided without a device sync

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.ids[self.offsets[i] : self.offsets[i + 1]], int(self.labels[i])

    def lengths(self) -> Tensor:
        return self._lengths

    def subset(self, order: Tensor) -> TokenSequences:
        pieces = [self.ids[self.offsets[i] : self.offsets[i + 1]] for i in order.tolist()]
        offsets = torch.zeros(len(pieces) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor([len(p) for p in pieces], dtype=torch.int64), 0)
        return TokenSequences(torch.cat(pieces) if pieces else self.ids[:0], offsets, self.labels[order], self.pad_id)

    def gather(self, index: Tensor, width: int | None = None) -> dict[str, Tensor]:
        """``{"input_ids", "attention_mask", "labels"}`` of the samples ``index`` (CPU int64, any shape
        ``[..., B]``), right-padded with ``pad_id`` to ``width`` (default: the longest of them); on the
        device of ``ids``."""
        lengths = self._lengths[index]
        if width is None:
            width = int(lengths.max()) if index.numel() else 0
        mask = torch.arange(width) < lengths.unsqueeze(-1)
        positions = (self.offsets[:-1][index].unsqueeze(-1) + torch.arange(width)).clamp_(max=max(len(self.ids) - 1, 0))
        device = self.ids.device
        mask, positions = mask.to(device, non_blocking=True), positions.to(device, non_blocking=True)
        input_ids = torch.where(mask, self.ids[positions], self.pad_id)
        labels = self.labels[index.to(device, non_blocking=True)]
        return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}

    def gather_steps(self, index: Tensor, step_dim: int) -> Iterator[dict[str, Tensor]]:
        """``gather(index.select(step_dim, k))`` for every step k, the steps' widths read at once:
        a round's local steps then never read a tensor's value on the host."""
        others = [d for d in range(index.dim()) if d != step_dim]
        widths = self._lengths[index].amax(dim=others).tolist() if index.numel() else [0] * index.shape[step_dim]
        for step, width in enumerate(widths):
            yield self.gather(index.select(step_dim, step), width)

    def to(self, device: torch.device) -> TokenSequences:
        """The same sequences with token ids and labels on ``device`` (offsets and lengths stay on the CPU)."""
        return TokenSequences(self.ids.to(device), self.offsets, self.labels.to(device), self.pad_id)


class PadCollate:
    """``[(ids, label), ...]`` -> ``{"input_ids", "attention_mask", "labels"}``, right-padded to the longest."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[tuple[Tensor, int]]) -> dict[str, Tensor]:
        length = max(len(ids) for ids, _ in items)
        input_ids = torch.full((len(items), length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(items), length), dtype=torch.int64)
        for row, (ids, _) in enumerate(items):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        labels = torch.tensor([label for _, label in items], dtype=torch.int64)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A tokenizer with a pad token (causal LMs lack one; the end-of-text token is used)."""
    from fl_lightning.core.hub import quiet_hub

    quiet_hub()  # no download or "Generating split" progress bars
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as error:
        from fl_lightning.core.hub import hub_error

        raise hub_error(
            "data.init_args.tokenizer", name_or_path, "tokenizer", error, "a local directory with the tokenizer files"
        ) from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer {name_or_path!r} has neither a pad nor an end-of-text token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_digest(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _to_sequences(ds) -> TokenSequences:
    """Arrow list column -> flat ids + offsets, without Python lists per sample."""
    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    column = ds.data.column("input_ids").combine_chunks()
    offsets = torch.from_numpy(column.offsets.to_numpy().astype("int64"))
    ids = torch.from_numpy(column.flatten().to_numpy().astype("int64"))
    labels = torch.from_numpy(ds.data.column("label").to_numpy().astype("int64"))
    return TokenSequences(ids, offsets - offsets[0], labels)


class TextDataModule(FederatedDataModule):
    """A GLUE task or 20 Newsgroups partitioned among clients.

    Args:
        task: one of ``TASKS`` (sst2, cola, mrpc, qqp, qnli, rte, mnli, 20news).
        tokenizer: hub id or local directory of the tokenizer (``"gpt2"``).
        max_length: tokens kept per sample (longer texts are truncated), >= 2.
        data_files: ``{split: path}`` of local files with the task's columns
            (parquet/csv/json), read by ``datasets.load_dataset`` instead of the hub;
            must hold the task's train split and its evaluation split.
        dataset_path: hub id or local path overriding the task's default source.
        cache_dir: the ``datasets`` cache directory (default: the library's).
        pair_separator: text put in front of the second sentence of a pair.
        trust_remote_code: passed to the tokenizer loader.
        Other arguments as in ``FederatedDataModule``.
    """

    def __init__(
        self,
        task: str = "sst2",
        tokenizer: str = "gpt2",
        max_length: int = 128,
        data_files: dict[str, str] | None = None,
        dataset_path: str | None = None,
        cache_dir: str | None = None,
        pair_separator: str = "\n",
        trust_remote_code: bool = False,
        num_clients: int = 100,
        partition: Partitioner | None = None,
        participation: Participation | None = None,
        holdout_fraction: float = 0.0,
        eval_batch_size: int = 128,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown text task {task!r}; allowed: {sorted(TASKS)}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        spec = TASKS[task]
        if data_files is not None:
            missing = {spec.train_split, spec.eval_split} - set(data_files)
            if missing:
                raise ValueError(
                    f"data_files for task {task!r} must have the splits {spec.train_split!r} and "
                    f"{spec.eval_split!r}; missing {sorted(missing)}"
                )
            suffixes = {Path(p).suffix for p in data_files.values()}
            if len(suffixes) != 1 or next(iter(suffixes)) not in _FILE_BUILDERS:
                raise ValueError(f"data_files must all be one of {sorted(_FILE_BUILDERS)}, got {sorted(suffixes)}")
        super().__init__(
            dataset=task,
            num_clients=num_clients,
            partition=partition,
            participation=participation,
            holdout_fraction=holdout_fraction,
            val_fraction=val_fraction,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )
        self.task, self.spec = task, spec
        self.tokenizer_name, self.max_length = tokenizer, max_length
        self.data_files = dict(data_files) if data_files is not None else None
        self.dataset_path, self.cache_dir = dataset_path, cache_dir
        self.pair_separator, self.trust_remote_code = pair_separator, trust_remote_code

    def _load_raw(self):
        from fl_lightning.core.hub import quiet_hub

        quiet_hub()  # no download or "Generating split" progress bars
        from datasets import load_dataset

        from fl_lightning.core.hub import hub_error

        if self.data_files is not None:
            builder = _FILE_BUILDERS[Path(next(iter(self.data_files.values()))).suffix]
            try:
                return load_dataset(builder, data_files=self.data_files, cache_dir=self.cache_dir)
            except OSError as error:
                raise hub_error("data.init_args.data_files", self.data_files, "data files", error,
                                "existing local files (one per split)") from error  # fmt: skip
        path = self.dataset_path or self.spec.path
        try:
            return load_dataset(path, self.spec.name, cache_dir=self.cache_dir)
        except OSError as error:
            raise hub_error(
                "data.init_args.dataset_path", path, f"{self.task} dataset", error,
                "a local copy (datasets save_to_disk/parquet directory) or use data.init_args.data_files",
            ) from error

    def _tokenize(self, ds, tokenizer, tokenizer_digest: str) -> TokenSequences:
        missing = [c for c in (*self.spec.fields, "label") if c not in ds.column_names]
        if missing:
            raise ValueError(f"task {self.task!r} needs columns {missing} in its data; found {ds.column_names}")
        fields, sep, max_length = self.spec.fields, self.pair_separator, self.max_length
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id

        def encode(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            first = [t or "" for t in batch[fields[0]]]
            if len(fields) == 2:
                second = [sep + (t or "") for t in batch[fields[1]]]
                enc = tokenizer(first, second, truncation=True, max_length=max_length)
            else:
                enc = tokenizer(first, truncation=True, max_length=max_length)
            return {"input_ids": [ids or [eos] for ids in enc["input_ids"]], "label": batch["label"]}

        key = "|".join(
            [_CACHE_VERSION, ds._fingerprint, tokenizer_digest, str(max_length), repr(fields), repr(sep)]
        )
        tokenized = ds.map(
            encode,
            batched=True,
            remove_columns=ds.column_names,
            new_fingerprint=hashlib.sha256(key.encode()).hexdigest()[:32],
            desc=f"tokenizing {self.task}",
        )
        return _to_sequences(tokenized)

    def build_source(self) -> DataSource:
        tokenizer = load_tokenizer(self.tokenizer_name, self.trust_remote_code)
        digest = _tokenizer_digest(tokenizer)  # before use: calling it records truncation settings in its state
        raw = self._load_raw()
        train = self._tokenize(raw[self.spec.train_split], tokenizer, digest)
        test = self._tokenize(raw[self.spec.eval_split], tokenizer, digest)
        k = self.spec.num_classes
        for split, data in (("train", train), (self.spec.eval_split, test)):
            if len(data) == 0:
                raise ValueError(f"task {self.task!r}: split {split!r} is empty")
            bad = (data.labels < 0) | (data.labels >= k)
            if bool(bad.any()):
                raise ValueError(
                    f"task {self.task!r}: split {split!r} has labels outside [0, {k}) "
                    f"(e.g. {int(data.labels[bad][0])}); unlabelled splits cannot be used"
                )
        # Length-sorted evaluation wastes almost no compute on padding; order does not change metrics.
        test = test.subset(torch.argsort(test.lengths(), stable=True))
        train.pad_id = test.pad_id = tokenizer.pad_token_id
        return DataSource(train, test, train.labels, k, collate_fn=PadCollate(tokenizer.pad_token_id))
