import numpy as np
import pytest
import torch

from datamodules import IID, Dirichlet, Shards


def _labels(n=1000, classes=10, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, classes, n))


def _assert_exact_cover(parts, n):
    everything = torch.cat(parts)
    assert len(everything) == n, "samples dropped or duplicated"
    assert torch.equal(everything.sort().values, torch.arange(n)), "not an exact partition"


@pytest.mark.parametrize("partitioner", [IID(), Dirichlet(0.1, min_size=10), Dirichlet(100.0), Shards(2)])
def test_partition_is_exact_cover(partitioner):
    labels = _labels()
    parts = partitioner(labels, 20, seed=3)
    assert len(parts) == 20
    _assert_exact_cover(parts, len(labels))


def test_dirichlet_respects_min_size_and_is_seeded():
    labels = _labels()
    parts = Dirichlet(0.1, min_size=10)(labels, 20, seed=7)
    assert min(len(p) for p in parts) >= 10
    again = Dirichlet(0.1, min_size=10)(labels, 20, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))


def _mean_label_distance_from_global(parts, labels, classes=10):
    glob = torch.bincount(labels, minlength=classes).double() / len(labels)
    tv = [0.5 * (torch.bincount(labels[p], minlength=classes).double() / len(p) - glob).abs().sum() for p in parts]
    return float(torch.stack(tv).mean())


def test_dirichlet_approaches_iid_as_alpha_grows():
    labels = _labels(5000)
    distances = [_mean_label_distance_from_global(Dirichlet(a)(labels, 10, seed=0), labels) for a in (0.05, 0.5, 5.0, 500.0)]
    assert all(a > b for a, b in zip(distances, distances[1:])), distances
    assert distances[0] > 0.5 and distances[-1] < 0.05, distances


def test_shards_give_few_labels_per_client():
    labels = _labels(1000)
    parts = Shards(2)(labels, 50, seed=0)
    assert max(len(torch.unique(labels[p])) for p in parts) <= 4


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Dirichlet(0.0), "alpha must be > 0"),
        (lambda: Dirichlet(-1.0), "alpha must be > 0"),
        (lambda: Dirichlet(1.0, min_size=0), "min_size must be >= 1"),
        (lambda: Dirichlet(1.0, min_size=60)(_labels(1000), 20, 0), "num_clients \\* min_size <= 1000"),
        (lambda: Shards(0), "shards_per_client must be >= 1"),
    ],
)
def test_bad_partition_settings_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()
