"""Tiny local copies of the hub vision datasets: parquet files with the hub schema (PNG bytes + label).

``fl-lightning fixture DATASET --out DIR [--train N --test N]`` writes one and prints the
``dataset_args`` that point a config at it (offline runs, smoke tests)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from .vision import SPECS

# Columns of the hub datasets (uoft-cs/cifar10: img/label; uoft-cs/cifar100: img/fine_label/coarse_label;
# ylecun/mnist: image/label; zh-plus/tiny-imagenet: image/label, splits train/valid).
HUB_COLUMNS = {
    "cifar10": ("img", ["label"]),
    "cifar100": ("img", ["fine_label", "coarse_label"]),
    "mnist": ("image", ["label"]),
    "tiny_imagenet": ("image", ["label"]),
}


def png_bytes(array: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array).save(buf, format=fmt)
    return buf.getvalue()


def write_fixture(root: Path, name: str, n_train: int = 40, n_test: int = 16, seed: int = 0) -> dict[str, str]:
    """Write ``train`` and test-split parquet files for ``name``; return ``data_files`` for them.

    Images are random with a class-dependent mean, so a model can learn something.
    """
    import datasets

    spec = SPECS[name]
    image_col, label_cols = HUB_COLUMNS[name]
    rng = np.random.default_rng(seed)
    files = {}
    for split, n in (("train", n_train), (spec.test_split, n_test)):
        labels = rng.integers(0, spec.num_classes, size=n)
        base = (labels * 255 // max(spec.num_classes - 1, 1))[:, None, None, None]
        noise = rng.integers(-40, 41, size=(n, spec.size, spec.size, spec.channels))
        arrays = np.clip(base + noise, 0, 255).astype(np.uint8)
        columns = {image_col: [{"bytes": png_bytes(a), "path": None} for a in arrays]}
        features = {image_col: datasets.Image()}
        for col in label_cols:
            k = spec.num_classes if col != "coarse_label" else 20
            columns[col] = (labels % k).tolist()
            features[col] = datasets.ClassLabel(num_classes=k)
        if name == "tiny_imagenet" and n:  # the hub copy holds some greyscale JPEGs among the RGB ones
            columns[image_col][0] = {"bytes": png_bytes(arrays[0][..., :1], "JPEG"), "path": None}
        ds = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
        path = root / f"{name}-{split}.parquet"
        ds.to_parquet(str(path))
        files[split] = str(path)
    return files


def main(argv: list[str]) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="fl-lightning fixture",
        description="Write a tiny offline copy of a hub vision dataset (parquet, hub schema) and print the "
        "dataset_args JSON that points a config at it: --data.init_args.dataset_args '<printed JSON>'.",
    )
    parser.add_argument("dataset", choices=sorted(HUB_COLUMNS), help="which dataset's schema")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--train", type=int, default=200, help="training images (default 200)")
    parser.add_argument("--test", type=int, default=100, help="test images (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    if ns.train < 1 or ns.test < 1:
        raise ValueError(f"fixture --train and --test must be >= 1, got {ns.train} and {ns.test}")
    import datasets

    datasets.disable_progress_bars()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_fixture(out, ns.dataset, ns.train, ns.test, ns.seed)
    print(json.dumps({"data_files": files, "cache_dir": str(out / "cache")}))
