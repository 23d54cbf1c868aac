"""Tiny local copies of the hub vision datasets: parquet files with the hub schema (PNG bytes + label)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from datamodules.vision import SPECS

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


if __name__ == "__main__":  # python -m tests.vision_fixture OUTDIR DATASET [N_TRAIN N_TEST]
    import json
    import sys

    out, name = Path(sys.argv[1]), sys.argv[2]
    sizes = [int(a) for a in sys.argv[3:5]] or [200, 100]
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"data_files": write_fixture(out, name, *sizes), "cache_dir": str(out / "cache")}))
