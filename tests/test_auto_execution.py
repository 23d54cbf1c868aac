"""``execution: auto`` (fl_lightning/executors/auto.py): the trial schedule, the choice by measured time, a rerun
with the recorded choice bitwise, resume, the record in config.yaml and the refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from fl_lightning import algorithms
from fl_lightning.engine.module import FederatedModule
from fl_lightning.executors import AutoExecutor, resolve_executor
from tests.conftest import (
    assert_resumes_bitwise,
    tiny_datamodule,
    tiny_module,
    tiny_trainer,
)

ROOT = Path(__file__).resolve().parents[1]
TWO = ["sequential", "batched"]


def _fit(directory, executor, rounds=6, ckpt=None, **trainer):
    torch.manual_seed(0)
    module = tiny_module(algorithms.SCAFFOLD())  # client state: the store differs if a round ran differently
    module = FederatedModule(module.model, module.algorithm, module.local, execution=executor)
    tiny_trainer(directory, rounds, **trainer).fit(module, datamodule=tiny_datamodule(), ckpt_path=ckpt)
    return module


class Timed(AutoExecutor):
    """Batched made to look slower (its timed round sleeps), so the measured choice is known."""

    def _timed(self, method, tasks, info, runtime):
        name, timed = self._current()
        if timed and name == "batched" and not any(t.warmup for t in tasks):
            original = self.executors[name].run

            def slow(*a):
                import time

                time.sleep(0.2)
                return original(*a)

            self.executors[name].run = slow
            try:
                return super()._timed(method, tasks, info, runtime)
            finally:
                self.executors[name].run = original
        return super()._timed(method, tasks, info, runtime)


def test_the_trial_rounds_run_each_candidate_then_the_fastest(tmp_path, caplog):
    executor = Timed(TWO, rounds_each=2)
    measured = _fit(tmp_path / "m", executor)
    assert executor.choice == "sequential" and set(executor.seconds_per_step) == set(TWO)
    assert executor.seconds_per_step["batched"] > executor.seconds_per_step["sequential"]
    assert "execution auto: sequential" in caplog.text and "--model.execution.init_args.choice sequential" in caplog.text
    assert executor.executors["batched"].stats["rounds"] == 2  # rounds 2 and 3 ran batched, the rest sequentially
    # a run with the recorded choice runs the same schedule without timing it: bitwise the measuring run
    rerun = _fit(tmp_path / "r", AutoExecutor(TWO, rounds_each=2, choice="sequential"))
    for a, b in zip(measured.model.parameters(), rerun.model.parameters()):
        assert torch.equal(a, b)
    assert measured.store.equal(rerun.store)
    # and it equals plain sequential execution to float tolerance (batched rounds 2-3 differ in summation order)
    plain = _fit(tmp_path / "s", "sequential")
    for a, b in zip(measured.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_resume_keeps_the_schedule_and_the_choice(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt=None):
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        return _fit(directory, AutoExecutor(TWO, rounds_each=2, choice="batched"), rounds, ckpt, enable_checkpointing=True,
                    callbacks=[checkpoint])  # fmt: skip

    _, resumed = assert_resumes_bitwise(run, tmp_path)  # resumed at round 2: the batched trial rounds, then batched
    assert resumed.training_executor._rounds == 4 - 2 + 2
    # a measured choice comes back from the checkpoint and is not measured again
    executor = Timed(TWO, rounds_each=2)
    _fit(tmp_path / "d", executor, rounds=5, enable_checkpointing=True,
         callbacks=[ModelCheckpoint(dirpath=tmp_path / "d" / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)])  # fmt: skip
    again = AutoExecutor(TWO, rounds_each=2)
    _fit(tmp_path / "e", again, rounds=6, ckpt=str(tmp_path / "d" / "ckpt" / "last.ckpt"))
    assert again.choice == "sequential" and again.seconds_per_step == executor.seconds_per_step


def test_auto_from_the_cli_records_its_choice_in_the_runs_config_and_reruns_from_it(tmp_path):
    args = [str(Path(sys.executable).with_name("fl-lightning")), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--model.execution", "auto",
            "--trainer.max_steps", "5", "--trainer.val_check_interval", "5", "--trainer.default_root_dir", str(tmp_path / "runs")]  # fmt: skip
    first = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (config,) = (tmp_path / "runs").rglob("config.yaml")
    recorded = yaml.safe_load(config.read_text())["model"]["execution"]
    choice = recorded["init_args"]["choice"]
    assert recorded["class_path"] == "fl_lightning.executors.auto.AutoExecutor" and choice in TWO
    assert f"execution auto: {choice}" in first.stdout.strip().splitlines()[-1]
    again = subprocess.run([args[0], "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "again")], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    ((metrics_a,), (metrics_b,)) = (tmp_path / "runs").rglob("metrics.csv"), (tmp_path / "again").rglob("metrics.csv")

    def logged(path):
        import csv

        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in csv.DictReader(open(path))]

    assert logged(metrics_a) == logged(metrics_b)  # the rerun from the recorded config: the same numbers


def test_auto_is_a_short_name_and_its_settings_are_refused_in_one_line():
    assert isinstance(resolve_executor("auto").inner, AutoExecutor)
    with pytest.raises(ValueError, match=r"execution.rounds_each must be an integer >= 2"):
        AutoExecutor(rounds_each=1)
    with pytest.raises(ValueError, match=r"execution.choice must be one of the candidates"):
        AutoExecutor(TWO, choice="batched_compiled")
    with pytest.raises(ValueError, match=r"execution.candidates must be distinct names"):
        AutoExecutor(["sequential", "vmap"])
    with pytest.raises(ValueError, match=r"model.execution=auto measures on one process; with 2 \(DDP\) set execution.choice"):
        AutoExecutor(TWO).check(SimpleNamespace(processes=2))
    AutoExecutor(TWO, choice="batched").check(SimpleNamespace(processes=2))  # a fixed choice runs under DDP
