"""Binary tasks of the personalization experiment: digits offline, MNIST through `datasets` (tiny local fixture)."""

import numpy as np
import torch

from datamodules import load_source


def test_binary_digits_labels_are_digit_at_least_threshold_and_partitions_see_ten_classes():
    digits, binary = load_source("digits"), load_source("binary_digits", threshold=5)
    assert binary.num_classes == 2
    assert torch.equal(binary.train.tensors[1], (digits.train.tensors[1] >= 5).long())
    assert torch.equal(binary.train_labels, digits.train_labels)  # label-skew partitions use the digit


def test_binary_mnist_loads_the_hub_layout_through_datasets(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Image
    from PIL import Image as PILImage

    rng = np.random.default_rng(0)
    features = Features({"image": Image(), "label": ClassLabel(names=[str(i) for i in range(10)])})
    pixels = {}
    for split, n in (("train", 20), ("test", 10)):  # the parquet layout of ylecun/mnist on the Hub
        pixels[split] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        images = [PILImage.fromarray(p) for p in pixels[split]]
        Dataset.from_dict({"image": images, "label": [i % 10 for i in range(n)]}, features=features).to_parquet(
            str(tmp_path / f"{split}-00000-of-00001.parquet")
        )
    source = load_source("binary_mnist", path=str(tmp_path), threshold=5, max_train=12)
    x, y = source.train.tensors
    assert x.shape == (12, 1, 28, 28) and source.num_classes == 2
    torch.testing.assert_close(x[3, 0], torch.tensor(pixels["train"][3], dtype=torch.float32) / 255.0)
    assert y.tolist() == [int(i % 10 >= 5) for i in range(12)]
    assert source.train_labels.tolist() == [i % 10 for i in range(12)]
    assert len(source.test) == 10
