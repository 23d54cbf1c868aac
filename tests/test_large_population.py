"""10^6 clients: partitions as one flat index tensor with offsets (datamodules/client_indices.py), the same
partitions as the per-client lists, and a run of configs/large_population.yaml that reaches round 1."""

import hashlib
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import IID, Contiguous, Dirichlet, QuantitySkew
from datamodules.client_indices import ClientIndices, NoIndices

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("partition", [IID(), QuantitySkew(), QuantitySkew("dirichlet", alpha=0.5), Contiguous(), Dirichlet(0.3)])
@pytest.mark.parametrize("num_clients", [1, 7, 100])
def test_a_flat_partition_holds_the_per_client_lists(partition, num_clients):
    labels = torch.randint(0, 10, (1000,), generator=torch.Generator().manual_seed(0))
    parts, flat = partition(labels, num_clients, 3), partition.flat(labels, num_clients, 3)
    assert len(flat) == len(parts) == num_clients
    for a, b in zip(parts, flat, strict=True):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
    assert torch.equal(flat.sizes(), torch.tensor([len(p) for p in parts]))
    assert sorted(flat.flat.tolist()) == list(range(1000))  # an exact partition
    reference = hashlib.sha256()  # fingerprint.partition_digest's client-by-client bytes
    for p in parts:
        reference.update(len(p).to_bytes(8, "little") + p.numpy().tobytes())
    assert hashlib.sha256(flat.digest_bytes()).digest() == reference.digest()


def test_iid_is_numpys_array_split_of_one_permutation():
    """Independent reference: the sorted chunks of np.array_split (the first n % N one larger)."""
    labels = torch.zeros(103, dtype=torch.int64)
    flat = IID().flat(labels, 10, 5)
    perm = np.random.default_rng(5).permutation(103)
    for got, chunk in zip(flat, np.array_split(perm, 10), strict=True):
        assert got.tolist() == sorted(chunk.tolist())
    assert flat[-1].tolist() == flat[9].tolist()
    with pytest.raises(IndexError):
        flat[10]
    assert len(NoIndices(3)[2]) == 0 and len(list(NoIndices(3))) == 3


def test_a_million_clients_reach_round_one_without_a_tensor_per_client(tmp_path, monkeypatch):
    """configs/large_population.yaml (10^6 clients, 10 a round): the partition took 100+ s of per-client
    tensors and permutations before round 0; now the setup is a few vectorised operations."""
    from fl_lightning.commands.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(ROOT / "configs" / "large_population.yaml"), "--trainer.max_steps", "1",
                     "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                     "--trainer.enable_checkpointing", "false"], run=False)  # fmt: skip
    data = cli.datamodule
    start = time.perf_counter()
    data.setup("fit")
    setup_s = time.perf_counter() - start
    assert isinstance(data.client_train, ClientIndices) and isinstance(data.client_holdout, NoIndices)
    assert len(data.client_train) == len(data.client_sizes) == 1_000_000
    assert int(data.client_sizes.sum()) == len(data.source.train_labels) == 1_980_000
    assert setup_s < 30, f"setup of 10^6 clients took {setup_s:.1f} s"  # ~2 s on a quiet 2-core machine
    cli.trainer.fit(cli.model, datamodule=data)
    assert cli.trainer.global_step == 1
    metrics = cli.trainer.callback_metrics
    assert float(metrics["train/clients"]) == 10 and torch.isfinite(metrics["train/loss"])


def test_a_holdout_split_of_many_clients_is_made_per_client_when_asked_for():
    """holdout_fraction with 10^5 clients: no pass over the clients at setup; a client's parts are the rule's
    (a permutation seeded by (seed, client, 0x401D): the first floor(h n) held out, the rest train, each sorted)."""
    from datamodules import FederatedDataModule
    from fl_lightning.core.participation import UniformSampling, derive_seed

    data = FederatedDataModule("synthetic", {"num_samples": 400_000, "num_features": 4, "test_fraction": 0.25}, num_clients=100_000,
                               partition=IID(), participation=UniformSampling(10), holdout_fraction=0.5, seed=2)  # fmt: skip
    data.setup()
    assert int(data.client_sizes.sum()) == 200_000 and int(data.client_sizes.max()) == 2  # 3 samples: 1 held out, 2 train
    assert len(data.client_train._cache) == 0, "no client's split is made before it is asked for"
    client = 76_543
    indices = IID().flat(data.source.train_labels, 100_000, 2)[client]
    perm = indices[torch.randperm(len(indices), generator=torch.Generator().manual_seed(derive_seed(2, client, 0x401D)))]
    held = len(indices) // 2
    assert data.client_holdout[client].tolist() == sorted(perm[:held].tolist())
    assert data.client_train[client].tolist() == sorted(perm[held:].tolist())
    assert len(data.client_train[client]) == int(data.client_sizes[client])
