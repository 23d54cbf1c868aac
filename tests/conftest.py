"""Shared builders for tiny federated runs."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch

from datamodules import IID, Dirichlet, FederatedDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.core.objective import Objective
from fl_lightning.executors import BatchedExecutor
from models import MLP


def tiny_datamodule(num_clients: int = 6, clients_per_round: int | float = 3, partition=None, **kw) -> FederatedDataModule:
    return FederatedDataModule(
        dataset="synthetic",
        dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1},
        num_clients=num_clients,
        partition=partition if partition is not None else Dirichlet(0.5, min_size=5),
        participation=UniformSampling(clients_per_round),
        **kw,
    )


def tiny_module(algorithm=None, local: LocalTraining | None = None, seed: int = 0) -> FederatedModule:
    torch.manual_seed(seed)
    return FederatedModule(
        model=MLP(in_features=8, num_classes=3, hidden=[16]),
        algorithm=algorithm,
        local=local or LocalTraining(lr=0.1, steps=3, batch_size=8),
    )


def tiny_trainer(tmp_path, rounds: int, **kw) -> L.Trainer:
    defaults = dict(
        max_steps=rounds,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
    )
    defaults.update(kw)
    return L.Trainer(**defaults)


@pytest.fixture
def iid():
    return IID()


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb without an account or a network, run files under ``tmp_path``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)


# One intra-op thread per test process: `pytest -n 2` on 2 cores would otherwise oversubscribe
# (measured: a 2-round fit 5x slower). Subprocesses started by tests inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# Tests exercise the parser itself, not stored answers (fl_lightning/run/answer_cache.py; its own tests opt in).
os.environ.setdefault("FL_LIGHTNING_CACHE_DIR", "off")


@pytest.fixture
def rows_calls(monkeypatch):
    """How many stacked evaluations ran as client rows."""
    calls = []
    as_rows = Objective._as_rows

    def counting(self, params, batch, *args, **kwargs):
        calls.append(batch["input_ids"].shape)
        return as_rows(self, params, batch, *args, **kwargs)

    monkeypatch.setattr(Objective, "_as_rows", counting)
    return calls


def fit_shipped_config(tmp_path, monkeypatch, config: str, *args: str) -> list[dict[str, str]]:
    """``fl-lightning fit --config configs/<config>.yaml`` for 2 rounds (one evaluation) from ``tmp_path``, a folder
    outside the checkout, with ``args`` after it; the rows of the run's metrics.csv."""
    import csv

    from fl_lightning.commands.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(Path(__file__).resolve().parents[1] / "configs" / f"{config}.yaml"), "--trainer.max_steps", "2",
          "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false", *args])  # fmt: skip
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    with open(metrics) as f:
        return list(csv.DictReader(f))


def fit_checkpointed(module: FederatedModule, folder: Path, rounds: int, data, ckpt_path: str | None = None) -> FederatedModule:
    """Fit ``module`` for ``rounds`` with a checkpoint after every round (``folder/ckpt/last.ckpt``): a ``run`` of
    ``assert_resumes_bitwise``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=folder / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    tiny_trainer(folder, rounds, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module


def assert_resumes_bitwise(run, tmp_path, min_clients: int = 1) -> tuple[FederatedModule, FederatedModule]:
    """``run(directory, rounds, ckpt_path=None) -> module`` for 4 rounds straight equals 2 rounds, then a resume
    from the 2-round run's ``ckpt/last.ckpt`` to 4: the model bitwise, the client store equal (and holding at
    least ``min_clients`` clients). Returns (straight, resumed) for further checks."""
    straight = run(tmp_path / "a", 4)
    run(tmp_path / "b", 2)
    resumed = run(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert len(straight.store) >= min_clients and straight.store.equal(resumed.store)
    return straight, resumed


@pytest.fixture
def stacked_sizes(monkeypatch):
    """The number of clients of every stack the batched executor runs."""
    sizes = []
    original = BatchedExecutor._run_stacked

    def spy(self, tasks, *args):
        sizes.append(len(tasks))
        return original(self, tasks, *args)

    monkeypatch.setattr(BatchedExecutor, "_run_stacked", spy)
    return sizes


SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")
"""The suite's longest tests by measured duration (``scripts/slow_tests.py`` writes it from ``--durations``): marked
``slow``, so ``pytest -m "not slow"`` is the few-minute daily loop; CI runs everything."""


def pytest_collection_modifyitems(config, items):
    if not SLOW_TESTS.is_file():
        return
    slow = {line.strip() for line in SLOW_TESTS.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow or item.nodeid.split("[")[0] in slow:
            item.add_marker(pytest.mark.slow)
