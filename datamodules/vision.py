"""CIFAR-10, CIFAR-100, TinyImageNet and MNIST through the Hugging Face ``datasets`` library.

Each split is decoded once into a uint8 tensor ``[n, C, H, W]`` plus int64
labels and cached as a safetensors file keyed by dataset, split and source, so
later runs skip the image decoding. Images stay uint8 in memory (CIFAR train:
150 MB; TinyImageNet train: 1.2 GB); ``VisionDataModule`` turns client batches
into normalized floats, with per-round augmentation (random crop with padding,
horizontal flip) and the optional client-specific colour perturbation.

Where the data comes from (``dataset_args``):
  * default: the hub id (``uoft-cs/cifar10``, ``uoft-cs/cifar100``,
    ``zh-plus/tiny-imagenet``, ``ylecun/mnist``), downloaded by ``datasets``;
  * ``path``: another hub id, a local dataset folder, or a folder written by
    ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
  * ``data_files``: local files per split, e.g. ``{"train": "x/train-*.parquet",
    "test": "x/test.parquet"}`` (parquet, arrow or json, from the extension);
  * ``cache_dir``: where ``datasets`` keeps its downloads and where the decoded
    tensors go (default ``$FL_LIGHTNING_CACHE`` or ``~/.cache/fl_lightning``).
All routes end in the same ``datasets.Dataset`` and the same decode and cache code.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .augment import ColorPerturbation, normalize, random_crop, random_hflip, to_unit_float
from .federated import FederatedDataModule
from .sources import DataSource, register


@dataclass(frozen=True)
class VisionSpec:
    """What a hub dataset looks like: columns, splits, shape and channel statistics."""

    hub_id: str
    image_columns: tuple[str, ...]
    label_column: str
    test_split: str
    num_classes: int
    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_padding: int
    flip: bool


SPECS: dict[str, VisionSpec] = {
    "cifar10": VisionSpec(
        "uoft-cs/cifar10", ("img", "image"), "label", "test", 10, 3, 32,
        (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 4, True,
    ),
    "cifar100": VisionSpec(
        "uoft-cs/cifar100", ("img", "image"), "fine_label", "test", 100, 3, 32,
        (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 4, True,
    ),
    "tiny_imagenet": VisionSpec(
        "zh-plus/tiny-imagenet", ("image", "img"), "label", "valid", 200, 3, 64,
        (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262), 8, True,
    ),
    "mnist": VisionSpec(
        "ylecun/mnist", ("image", "img"), "label", "test", 10, 1, 28, (0.1307,), (0.3081,), 2, False,
    ),
}  # fmt: skip

_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("FL_LIGHTNING_CACHE", Path.home() / ".cache" / "fl_lightning"))


def _files_list(files: Any) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def _open_split(spec: VisionSpec, split: str, path: str | None, data_files: dict | None, cache_dir: str | None,
                revision: str | None):  # fmt: skip
    """The split as a ``datasets.Dataset`` (hub id, local folder, saved dataset or data files)."""
    import datasets

    if data_files is not None:
        if split not in data_files:
            raise ValueError(f"data_files has no {split!r} split; given: {sorted(data_files)}")
        ext = Path(_files_list(data_files[split])[0]).suffix
        if ext not in _BUILDERS:
            raise ValueError(f"data_files must end in one of {sorted(_BUILDERS)}, got {ext!r}")
        return datasets.load_dataset(_BUILDERS[ext], data_files=data_files, split=split, cache_dir=cache_dir)
    source = path or spec.hub_id
    if Path(source).is_dir() and (Path(source) / "dataset_dict.json").exists():
        return datasets.load_from_disk(source)[split]
    if Path(source).is_dir() and (Path(source) / "state.json").exists():  # one Dataset.save_to_disk
        return datasets.load_from_disk(source)
    return datasets.load_dataset(source, split=split, cache_dir=cache_dir, revision=revision)


def _local_stamp(path: str | None, data_files: dict | None) -> list:
    """Size and mtime of local source files, so a changed local file is decoded again."""
    patterns = [p for v in (data_files or {}).values() for p in _files_list(v)]
    if path and Path(path).exists():
        patterns.append(str(Path(path) / "**" / "*") if Path(path).is_dir() else path)
    stamp = []
    for pattern in patterns:
        for f in sorted(glob.glob(pattern, recursive=True)):
            if os.path.isfile(f):
                st = os.stat(f)
                stamp.append((f, st.st_size, st.st_mtime_ns))
    return stamp


def decode_images(ds, spec: VisionSpec, label_column: str, batch_size: int = 2048) -> tuple[Tensor, Tensor]:
    """Decode a ``datasets.Dataset`` of images + labels into ``uint8 [n, C, H, W]`` and ``int64 [n]``."""
    image_column = next((c for c in spec.image_columns if c in ds.column_names), None)
    if image_column is None or label_column not in ds.column_names:
        raise ValueError(
            f"dataset columns {ds.column_names} lack an image column ({' or '.join(spec.image_columns)}) "
            f"or the label column {label_column!r}"
        )
    mode = "RGB" if spec.channels == 3 else "L"
    n = len(ds)
    images = np.empty((n, spec.size, spec.size, spec.channels), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    pos = 0
    for batch in ds.select_columns([image_column, label_column]).iter(batch_size=batch_size):
        for img in batch[image_column]:
            arr = np.asarray(img.convert(mode))  # TinyImageNet holds some greyscale images: convert
            if arr.shape[:2] != (spec.size, spec.size):
                raise ValueError(f"image {pos} has size {arr.shape[:2]}, expected {spec.size}x{spec.size}")
            images[pos] = arr.reshape(spec.size, spec.size, spec.channels)
            pos += 1
        labels[pos - len(batch[label_column]) : pos] = batch[label_column]
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels)


def load_split(
    name: str,
    split: str,
    path: str | None = None,
    data_files: dict | None = None,
    cache_dir: str | None = None,
    revision: str | None = None,
    label_column: str | None = None,
) -> tuple[Tensor, Tensor]:
    """One split of a vision dataset as ``(uint8 images [n, C, H, W], int64 labels [n])``, cached on disk."""
    from safetensors.torch import load_file, save_file

    spec = SPECS[name]
    label_column = label_column or spec.label_column
    key = json.dumps(
        [path or spec.hub_id, data_files, _local_stamp(path, data_files), revision, label_column, spec.size, spec.channels],
        sort_keys=True,
        default=str,
    )
    root = Path(cache_dir) / "decoded" if cache_dir else default_cache_dir()
    cache = root / f"{name}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    if cache.exists():
        tensors = load_file(str(cache))
        return tensors["images"], tensors["labels"]
    try:
        ds = _open_split(spec, split, path, data_files, cache_dir, revision)
    except OSError as error:  # not downloaded and no network (datasets' ConnectionError), or no such dataset or file
        from fl_lightning.core.hub import hub_error

        setting, value = ("data.init_args.dataset_args.data_files", data_files) if data_files else ("data.init_args.dataset_args.path", path or spec.hub_id)
        raise hub_error(
            setting, value, f"{name} dataset", error,
            "a local copy (a datasets save_to_disk folder), or set data.init_args.dataset_args.data_files to local files",
        ) from error
    images, labels = decode_images(ds, spec, label_column)
    root.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".tmp{os.getpid()}")
    save_file({"images": images, "labels": labels}, str(tmp), metadata={"source": key})
    os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
    return images, labels


def _vision_source(name: str):
    def load(
        path: str | None = None,
        data_files: dict | None = None,
        cache_dir: str | None = None,
        revision: str | None = None,
        label_column: str | None = None,
        max_train: int | None = None,
        max_test: int | None = None,
    ) -> DataSource:
        spec = SPECS[name]
        args = dict(path=path, data_files=data_files, cache_dir=cache_dir, revision=revision, label_column=label_column)
        x_train, y_train = load_split(name, "train", **args)
        x_test, y_test = load_split(name, spec.test_split, **args)
        if max_train is not None:  # a prefix, for smoke tests
            x_train, y_train = x_train[:max_train], y_train[:max_train]
        if max_test is not None:
            x_test, y_test = x_test[:max_test], y_test[:max_test]
        num_classes = spec.num_classes if label_column in (None, spec.label_column) else int(y_train.max()) + 1
        return DataSource(TensorDataset(x_train, y_train), TensorDataset(x_test, y_test), y_train, num_classes)

    load.__doc__ = f"{name} ({SPECS[name].hub_id}) as uint8 images; use it through ``VisionDataModule``."
    return load


for _name in SPECS:
    register(_name)(_vision_source(_name))


class _NormalizedBatches(Dataset):
    """Consecutive batches of a uint8 ``TensorDataset``, normalized (one slice per item, no per-image indexing)."""

    def __init__(self, data: TensorDataset, batch_size: int, transform) -> None:
        self.x, self.y = data.tensors
        self.batch_size, self.transform = batch_size, transform

    def __len__(self) -> int:
        return (len(self.y) + self.batch_size - 1) // self.batch_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.transform(self.x[sl]), self.y[sl]


class VisionDataModule(FederatedDataModule):
    """A vision dataset split among clients, with per-round augmentation in torch.

    Training batches of client ``i``: uint8 -> [0, 1] -> colour perturbation of
    client ``i`` (if set) -> random crop with zero padding -> horizontal flip ->
    per-channel normalization. The crops and flips come from a generator
    seeded by the client's round seed, so they are fixed by (seed, round,
    client). A client's full-batch and holdout views get its colour
    perturbation and normalization, no random augmentation; the global
    validation/test set is normalized only.

    Args:
        dataset: ``cifar10``, ``cifar100``, ``tiny_imagenet`` or ``mnist``.
        dataset_args: ``path``, ``data_files``, ``cache_dir``, ``revision``,
            ``label_column`` (e.g. ``coarse_label``), ``max_train``/``max_test``.
        crop_padding: padding of the random crop (0: no crop); default per dataset
            (4 for CIFAR, 8 for TinyImageNet, 2 for MNIST).
        flip: random horizontal flip; default on, off for MNIST.
        color: client-specific colour perturbation (FedMIM), or None.
        **kwargs: the ``FederatedDataModule`` settings (num_clients, partition, ...).
    """

    def __init__(
        self,
        dataset: str = "cifar10",
        dataset_args: dict[str, Any] | None = None,
        crop_padding: int | None = None,
        flip: bool | None = None,
        color: ColorPerturbation | None = None,
        **kwargs: Any,
    ) -> None:
        if dataset not in SPECS:
            raise ValueError(f"VisionDataModule dataset must be one of {sorted(SPECS)}, got {dataset!r}")
        spec = SPECS[dataset]
        if crop_padding is not None and not 0 <= crop_padding <= spec.size:
            raise ValueError(f"crop_padding must be in [0, {spec.size}], got {crop_padding}")
        super().__init__(dataset=dataset, dataset_args=dataset_args, **kwargs)
        self.spec = spec
        self.crop_padding = spec.crop_padding if crop_padding is None else crop_padding
        self.flip = spec.flip if flip is None else flip
        self.color = color

    def _normalize(self, x: Tensor) -> Tensor:
        return normalize(x, self.spec.mean, self.spec.std)

    def _eval_transform(self, images: Tensor) -> Tensor:
        return self._normalize(to_unit_float(images))

    def augment(self, batch: Any, client_id: int, generator: torch.Generator) -> Any:
        images, labels = batch
        x = to_unit_float(images)
        if self.color is not None:
            x = self.color(x, client_id, self.seed)
        x = random_crop(x, self.crop_padding, generator)
        if self.flip:
            x = random_hflip(x, generator)
        return self._normalize(x), labels

    def client_view(self, batch: Any, client_id: int) -> Any:
        images, labels = batch
        x = to_unit_float(images)
        if self.color is not None:
            x = self.color(x, client_id, self.seed)
        return self._normalize(x), labels

    def _eval_loader(self) -> DataLoader:
        return DataLoader(
            _NormalizedBatches(self.source.test, self.eval_batch_size, self._eval_transform), batch_size=None
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """The validation split (held out of the clients' training images), normalized as the test set is, then
        the test set; without ``val_fraction`` the test set alone. (The base loader passed the uint8 images on.)"""
        if not self.val_fraction:
            return self._eval_loader()
        images, labels = self.source.train.tensors
        index = self.validation_indices
        split = TensorDataset(images[index], labels[index])
        return [DataLoader(_NormalizedBatches(split, self.eval_batch_size, self._eval_transform), batch_size=None), self._eval_loader()]
