"""Extending from your own files: ``--import`` through the CLI (a data source registered by name, an
algorithm by class_path, float64 training), loader keyword names, fault draws independent of the
default dtype, run_task's failure policy."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from datamodules.sources import SOURCES, load_source, register
from fl_lightning.executors import Executor
from fl_lightning.executors.sequential import run_task
from fl_lightning.reliability.faults import ClientError, ClientFaults
from fl_lightning.commands.user_modules import take_import_option
from tests.conftest import tiny_datamodule, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]
CLI = Path(sys.executable).parent / "fl-lightning"  # the console script users run (not python -m)

USER_MODULE = '''
import torch
from torch.utils.data import TensorDataset

from datamodules.sources import DataSource, register
from fl_lightning.algorithms import FedAvg


@register("my_blobs")
def my_blobs(name: str = "blobs", n: int = 240, seed: int = 0):  # a loader parameter called `name`
    assert name == "three blobs"
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 2.0 * torch.nn.functional.one_hot(y, 8).float()
    return DataSource(TensorDataset(x[:200], y[:200]), TensorDataset(x[200:], y[200:]), y[:200], 3)


class ShrinkingFedAvg(FedAvg):
    """FedAvg whose server step is half the average update (a user's algorithm)."""

    def __init__(self, global_lr: float = 0.5) -> None:
        super().__init__(global_lr)
'''

CONFIG = """
base: {root}/configs/quickstart.yaml
trainer:
  max_steps: 2
  val_check_interval: 2
  precision: 64-true
  default_root_dir: runs/mine
  logger: {{init_args: {{save_dir: runs, name: mine}}}}
model:
  model: {{class_path: models.MLP, init_args: {{in_features: 8, num_classes: 3, hidden: [16]}}}}
  algorithm: {{class_path: my_ext.ShrinkingFedAvg}}
data:
  init_args:
    dataset: my_blobs
    dataset_args: {{name: three blobs}}
    num_clients: 6
    dtype: float64
    partition: {{class_path: datamodules.IID}}
    participation: {{init_args: {{clients_per_round: 3}}}}
"""


def _cli(tmp_path, *args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([str(CLI), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_a_user_module_registers_a_source_and_an_algorithm_through_import(tmp_path):
    """``fit --import my_ext``: my_ext.py in the working directory (not on PYTHONPATH) registers the
    dataset ``my_blobs`` (named in the config) and defines ``my_ext.ShrinkingFedAvg`` (a class_path);
    the run trains in float64 (trainer.precision 64-true, data.dtype float64) for 2 rounds."""
    (tmp_path / "my_ext.py").write_text(USER_MODULE)
    (tmp_path / "mine.yaml").write_text(CONFIG.format(root=ROOT))
    proc = _cli(tmp_path, "fit", "--import", "my_ext", "--config", "mine.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ShrinkingFedAvg: 2 rounds" in proc.stdout
    ckpt = torch.load(tmp_path / "runs/mine/version_0/checkpoints/last.ckpt", weights_only=False)
    weights = [v for k, v in ckpt["state_dict"].items() if k.startswith("model.")]
    assert weights and all(v.dtype == torch.float64 for v in weights)


def test_a_module_that_does_not_import_is_named_in_one_line(tmp_path):
    proc = _cli(tmp_path, "--import", "no_such_module_here", "fit", "--config", "x.yaml")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fl-lightning: error: --import: cannot import module 'no_such_module_here' (ModuleNotFoundError: No module named "
        "'no_such_module_here'); put the folder that holds it on PYTHONPATH or run from that folder"
    ]
    (tmp_path / "broken_ext.py").write_text("raise RuntimeError('oops\\nmore')\n")
    proc = _cli(tmp_path, "fit", "--import=broken_ext", "--config", "x.yaml")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "cannot import module 'broken_ext' (RuntimeError: oops); the error is raised inside the module" in proc.stderr


def test_import_option_forms():
    assert take_import_option(["--import", "a,b", "fit", "--import=c", "--config", "x"]) == (["fit", "--config", "x"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="--import needs module names"):
        take_import_option(["fit", "--import"])


def test_loader_keywords_may_be_called_name_or_dataset():
    @register("_named_loader")
    def loader(name: str = "", dataset: int = 0):
        return (name, dataset)

    try:
        assert load_source("_named_loader", name="x", dataset=3) == ("x", 3)
    finally:
        SOURCES.pop("_named_loader")


def test_fault_draws_do_not_depend_on_the_default_dtype():
    faults = ClientFaults(dropout=0.2, straggler=0.5)
    draws = {}
    for dtype in (torch.float32, torch.float64):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            draws[dtype] = [faults.draw(seed, 10) for seed in range(200)]
        finally:
            torch.set_default_dtype(previous)
    assert draws[torch.float32] == draws[torch.float64]
    assert len(set(draws[torch.float32])) > 3  # drops, stragglers of several lengths, full runs


class PerTaskExecutor(Executor):
    """A user's executor built on run_task: the tasks one by one, failed clients (None) left out."""

    def run(self, tasks, info, runtime):
        return [r for r in (run_task(t, info, runtime) for t in tasks) if r is not None]


def test_run_task_applies_the_client_failure_policy(tmp_path, caplog):
    from tests.test_faults import BROKEN, BrokenClient, _module

    module = _module(BrokenClient(), execution=PerTaskExecutor())
    with caplog.at_level(logging.WARNING):
        tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=6))
    assert f"client {BROKEN} failed and is left out of the aggregate: ClientFailure('sensor offline')" in caplog.text
    assert BROKEN not in module.store and len(module.store) == 5
    fail_fast = _module(BrokenClient(), ClientFaults(fail_fast=True), execution=PerTaskExecutor())
    with pytest.raises(ClientError, match=f"round 0: client {BROKEN} failed: ClientFailure"):
        tiny_trainer(tmp_path, rounds=1).fit(fail_fast, datamodule=tiny_datamodule(num_clients=6, clients_per_round=6))


def test_data_dtype_casts_floating_tensors_only():
    from datamodules import FederatedDataModule

    data = FederatedDataModule(dataset="digits", num_clients=4, dtype="float64")
    data.setup()
    x, y = data.source.train.tensors
    assert x.dtype == torch.float64 and y.dtype == torch.int64
    assert data.source.test.tensors[0].dtype == torch.float64
    plain = FederatedDataModule(dataset="digits", num_clients=4)
    plain.setup()
    assert torch.equal(plain.source.train.tensors[0].double(), x)  # the same values, cast
    with pytest.raises(ValueError, match=r"data.dtype must be one of \['float32', 'float64'\] or null, got 'float16'"):
        FederatedDataModule(dataset="digits", dtype="float16")
    with pytest.raises(ValueError, match="unknown dataset 'my_blobs'.*fl-lightning --import your_module"):
        FederatedDataModule(dataset="my_blobs")
