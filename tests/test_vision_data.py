"""Vision data: hub-schema parquet fixtures through the real loading/caching code, augmentation, colour shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import datamodules.vision as vision
from datamodules import IID, ColorPerturbation, QuantitySkew, VisionDataModule
from datamodules.augment import adjust_saturation, normalize, random_crop, random_hflip, to_unit_float
from fl_lightning import UniformSampling
from tests.vision_fixture import write_fixture


def _raw_images(files: dict, split: str, column: str) -> list[np.ndarray]:
    import datasets

    ds = datasets.load_dataset("parquet", data_files=files, split=split)
    return [np.asarray(im) for im in ds[column]]


@pytest.mark.parametrize(
    "name,split,shape,column",
    [
        ("cifar10", "train", (3, 32, 32), "img"),
        ("cifar100", "test", (3, 32, 32), "img"),
        ("mnist", "train", (1, 28, 28), "image"),
        ("tiny_imagenet", "valid", (3, 64, 64), "image"),
    ],
)
def test_load_split_decodes_hub_schema_and_caches(tmp_path, monkeypatch, name, split, shape, column):
    files = write_fixture(tmp_path, name, n_train=12, n_test=6)
    images, labels = vision.load_split(name, split, data_files=files, cache_dir=str(tmp_path / "c"))
    n = 12 if split == "train" else 6
    assert images.dtype == torch.uint8 and images.shape == (n, *shape)
    assert labels.dtype == torch.int64 and labels.shape == (n,)
    raw = _raw_images(files, split, column)
    if name != "tiny_imagenet":  # PNG is lossless: the decoded tensor is the image, channels first
        expect = np.stack(raw).reshape(n, shape[1], shape[2], shape[0]).transpose(0, 3, 1, 2)
        assert torch.equal(images, torch.from_numpy(expect))
    else:  # first image is a greyscale JPEG: converted to RGB, three equal channels
        assert raw[0].ndim == 2 and torch.equal(images[0, 0], images[0, 1])
    assert len(list((tmp_path / "c" / "decoded").glob(f"{name}-{split}-*.safetensors"))) == 1

    def no_decoding(*a, **k):
        raise AssertionError("cache miss: the split was decoded again")

    monkeypatch.setattr(vision, "_open_split", no_decoding)
    again = vision.load_split(name, split, data_files=files, cache_dir=str(tmp_path / "c"))
    assert torch.equal(again[0], images) and torch.equal(again[1], labels)


def test_cache_follows_the_source(tmp_path):
    files = write_fixture(tmp_path, "cifar100", n_train=8, n_test=4)
    cache = str(tmp_path / "c")
    _, fine = vision.load_split("cifar100", "train", data_files=files, cache_dir=cache)
    _, coarse = vision.load_split("cifar100", "train", data_files=files, cache_dir=cache, label_column="coarse_label")
    assert torch.equal(coarse, fine % 20) and not torch.equal(coarse, fine)
    before, _ = vision.load_split("cifar100", "train", data_files=files, cache_dir=cache)
    write_fixture(tmp_path, "cifar100", n_train=8, n_test=4, seed=1)  # same paths, new content
    after, _ = vision.load_split("cifar100", "train", data_files=files, cache_dir=cache)
    assert not torch.equal(before, after)


def test_bad_columns_and_splits_are_named(tmp_path):
    files = write_fixture(tmp_path, "mnist", n_train=4, n_test=2)
    with pytest.raises(ValueError, match="label column 'nope'"):
        vision.load_split("mnist", "train", data_files=files, cache_dir=str(tmp_path), label_column="nope")
    with pytest.raises(ValueError, match="no 'valid' split"):
        vision.load_split("tiny_imagenet", "valid", data_files=files, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="dataset must be one of"):
        VisionDataModule(dataset="imagenet")


def _dm(tmp_path, color=None, **kw) -> VisionDataModule:
    files = write_fixture(tmp_path, "cifar10", n_train=40, n_test=10)
    dm = VisionDataModule(
        dataset="cifar10",
        dataset_args={"data_files": files, "cache_dir": str(tmp_path / "c")},
        num_clients=4,
        partition=IID(),
        participation=UniformSampling(2),
        color=color,
        eval_batch_size=4,
        **kw,
    )
    dm.setup()
    return dm


def test_client_batches_are_augmented_deterministically_and_eval_is_normalized(tmp_path):
    dm = _dm(tmp_path)
    batches = list(dm.client_batches(1, seed=7, batch_size=4, epochs=1))
    assert [b[0].shape for b in batches] == [(4, 3, 32, 32)] * 2 + [(2, 3, 32, 32)]
    assert all(x.dtype == torch.float32 and y.dtype == torch.int64 for x, y in batches)
    again = list(dm.client_batches(1, seed=7, batch_size=4, epochs=1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))
    other = list(dm.client_batches(1, seed=8, batch_size=4, epochs=1))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(batches, other))

    x_u8, _ = dm.source.test.tensors
    evals = list(dm.val_dataloader())
    assert [x.shape[0] for x, _ in evals] == [4, 4, 2]
    expect = normalize(x_u8.float() / 255, vision.SPECS["cifar10"].mean, vision.SPECS["cifar10"].std)
    assert torch.allclose(torch.cat([x for x, _ in evals]), expect)


def test_without_random_augmentation_training_batches_are_the_normalized_images(tmp_path):
    dm = _dm(tmp_path, crop_padding=0, flip=False)
    (x, y), = list(dm.client_batches(2, seed=0, batch_size=None, steps=1))
    images = dm.source.train.tensors[0][dm.client_train[2]]
    assert torch.equal(y, dm.source.train.tensors[1][dm.client_train[2]])
    assert torch.allclose(x, normalize(images.float() / 255, dm.spec.mean, dm.spec.std))
    full_x, _ = dm.client_full_batch(2)
    assert torch.allclose(full_x, x)


def test_random_crop_is_a_window_of_the_padded_image_and_flip_mirrors():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 3, 6, 6)
    out = random_crop(x, 2, g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(16):
        windows = [padded[i, :, dy : dy + 6, dx : dx + 6] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(out[i], w) for w in windows)
    offsets = {tuple(int(v) for v in (out[i] != 0).nonzero().min(0).values[1:]) for i in range(16)}
    assert len(offsets) > 1, "every image got the same crop"
    flipped = random_hflip(x, g)
    same = [torch.equal(flipped[i], x[i]) for i in range(16)]
    assert all(s or torch.equal(flipped[i], x[i].flip(-1)) for i, s in enumerate(same))
    assert 0 < sum(same) < 16


def test_color_perturbation_is_per_client_deterministic_and_bounded(tmp_path):
    color = ColorPerturbation(brightness=0.3, saturation=0.5)
    factors = [color.factors(c, seed=0) for c in range(200)]
    assert factors == [color.factors(c, seed=0) for c in range(200)]
    assert len(set(factors)) == 200 and factors != [color.factors(c, seed=1) for c in range(200)]
    b, s = np.array(factors).T
    assert b.min() >= 0.7 and b.max() <= 1.3 and s.min() >= 0.5 and s.max() <= 1.5
    assert b.min() < 0.75 and b.max() > 1.25, "factors do not spread over the range"

    x = torch.rand(8, 3, 5, 5)
    y = color(x, 3, seed=0)
    assert y.min() >= 0 and y.max() <= 1
    assert torch.equal(adjust_saturation(x, 1.0), x)
    grey = adjust_saturation(x, 0.0)
    assert torch.allclose(grey[:, 0], grey[:, 1]) and torch.allclose(grey[:, 1], grey[:, 2])
    with pytest.raises(ValueError, match="brightness must be in"):
        ColorPerturbation(brightness=1.0)

    # Through the datamodule: each client's batches carry its own factors, in every round.
    dm = _dm(tmp_path, color=color, crop_padding=0, flip=False)
    for cid in (0, 3):
        images = dm.source.train.tensors[0][dm.client_train[cid]]
        want = normalize(color(to_unit_float(images), cid, dm.seed), dm.spec.mean, dm.spec.std)
        for seed in (1, 2):
            (got, _), = list(dm.client_batches(cid, seed=seed, batch_size=None, steps=1))
            assert torch.allclose(got, want)
        assert torch.allclose(dm.client_full_batch(cid)[0], want)
    plain = _dm(tmp_path / "p", crop_padding=0, flip=False)
    assert not torch.allclose(plain.client_full_batch(0)[0], dm.client_full_batch(0)[0])


@pytest.mark.parametrize("dist,kw", [("lognormal", {"sigma": 1.5}), ("dirichlet", {"alpha": 0.5})])
def test_quantity_skew_is_an_exact_partition_with_unequal_sizes(dist, kw):
    labels = torch.randint(0, 10, (5000,))
    parts = QuantitySkew(dist, min_size=5, **kw)(labels, 50, seed=3)
    everything = torch.cat(parts).sort().values
    assert torch.equal(everything, torch.arange(5000))
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.max() > 4 * np.median(sizes) / 2 and sizes.std() > 50
    again = QuantitySkew(dist, min_size=5, **kw)(labels, 50, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    equal = QuantitySkew("lognormal", sigma=0.0)(labels, 7, seed=0)
    assert max(len(p) for p in equal) - min(len(p) for p in equal) <= 1
    with pytest.raises(ValueError, match="min_size=200"):
        QuantitySkew(min_size=200)(labels, 50, seed=0)


def test_the_validation_split_is_normalized_like_the_test_set(tmp_path):
    """With val_fraction the first loader holds the validation images, normalized floats (the base loader passed the
    uint8 images on, and every vision config crashed at its first validation)."""
    dm = _dm(tmp_path, val_fraction=0.25)
    val, test = dm.val_dataloader()
    x_u8, y = dm.source.train.tensors
    index = dm.validation_indices
    batches = list(val)
    assert len(index) > 0 and all(x.dtype == torch.float32 for x, _ in batches)
    expect = normalize(x_u8[index].float() / 255, vision.SPECS["cifar10"].mean, vision.SPECS["cifar10"].std)
    assert torch.allclose(torch.cat([x for x, _ in batches]), expect) and torch.equal(torch.cat([t for _, t in batches]), y[index])
    assert len(list(test)) == 3  # the test set after it
