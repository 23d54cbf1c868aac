"""`fl-lightning tune`: the study file is checked (one line per bad setting, unequal budgets refused) before any trial;
a study killed with SIGKILL during a trial and run again ends with exactly the planned trials and the same trials and
best value as an uninterrupted one; the best trial is tested on fresh seeds and its settings written as a fit config."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from fl_lightning.commands.cli import main
from fl_lightning.experiments.study import load_study
from fl_lightning.experiments.tune_report import best_so_far, nested
from tests.test_compare import BASE

KILLER = '''
import os, signal
import lightning as L

class KillOnce(L.Callback):
    """SIGKILL this process in the middle of the trial whose folder ends with ``trial``, once (a marker file)."""
    def __init__(self, marker: str, trial: str) -> None:
        self.marker, self.trial = marker, trial
    def on_train_batch_end(self, trainer, *args):
        if trainer.default_root_dir.endswith(self.trial) and trainer.global_step == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
'''


def write_study(tmp_path: Path, **changes) -> Path:
    base = {**BASE, "data": {**BASE["data"], "init_args": {**BASE["data"]["init_args"], "val_fraction": 0.2}}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    study = {
        "base": str(tmp_path / "base.yaml"),
        "trials": 4, "rounds": 2, "evaluate_every": 1, "test_seeds": [7],
        "sampler": {"name": "tpe", "seed": 0, "n_startup_trials": 2},
        "pruner": {"name": "median", "n_startup_trials": 1},
        "methods": {"FedAvg": {"space": {"model.local.lr": {"float": [0.01, 1.0], "log": True}}}},
        **changes,
    }  # fmt: skip
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def finished(out: Path) -> list[tuple[dict, float | None, str]]:
    trials = optuna.load_study(study_name="FedAvg", storage=f"sqlite:///{out / 'study.db'}").get_trials()
    return [(t.params, t.value, t.state.name) for t in sorted(trials, key=lambda t: t.number) if t.state.name in ("COMPLETE", "PRUNED")]


def test_a_killed_study_resumes_to_the_planned_trials_and_the_uninterrupted_best(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "killer.py").write_text(KILLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    killer = {"class_path": "killer.KillOnce", "init_args": {"marker": str(tmp_path / "killed"), "trial": "trial001"}}
    study = write_study(tmp_path, overrides={"trainer.callbacks": [killer]})

    (tmp_path / "killed").touch()  # the uninterrupted study: nothing is killed
    main(["tune", "--config", str(study), "--out", "uninterrupted", "--no-test"])
    (tmp_path / "killed").unlink()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])])}
    command = [sys.executable, "-c", "from fl_lightning.commands.cli import main; main()", "tune", "--config", str(study), "--out", "resumed"]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / "killed").exists()
    main(["tune", "--config", str(study), "--out", "resumed"])

    whole, resumed = finished(tmp_path / "uninterrupted"), finished(tmp_path / "resumed")
    assert len(whole) == len(resumed) == 4  # exactly the planned trials, complete or pruned
    assert resumed == whole  # the same parameters, values and states, trial by trial
    states = [t.state.name for t in optuna.load_study(study_name="FedAvg", storage=f"sqlite:///{tmp_path / 'resumed' / 'study.db'}").get_trials()]
    assert states.count("FAIL") == 1  # the killed trial, kept as failed, its folder beside the others
    assert (tmp_path / "resumed" / "runs" / "FedAvg" / "trial001").is_dir()

    summary = list(csv.DictReader(open(tmp_path / "resumed" / "summary.csv")))[0]
    best = max(v for _, v, s in whole if s == "COMPLETE")
    assert float(summary["best_value"]) == best and summary["failed"] == "1"
    assert 0 <= float(summary["test_acc_mean"]) <= 1 and summary["test_runs"] == "1"
    config = yaml.safe_load((tmp_path / "resumed" / "best" / "FedAvg.yaml").read_text())
    assert config["model"]["local"]["lr"] == yaml.safe_load(summary["best_params"])["model.local.lr"]
    assert (tmp_path / "resumed" / "best_so_far.png").stat().st_size > 0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"trials": 0}, "trials must be an integer >= 1, got 0"),
        ({"evaluate_every": 5}, r"evaluate_every must be in 1..rounds \(2\), got 5"),
        ({"methods": {"A": {"space": {"model.local.lr": {"float": [0.0, 1.0], "log": True}}}}}, "low > 0 \\(log scale\\)"),
        ({"methods": {"A": {"space": {"model.local.lr": {"uniform": [0.1, 1.0]}}}}}, "give exactly one of float, int, choice"),
        ({"methods": {"A": {"set": {"trainer.max_steps": 3}}}}, "trainer.max_steps is set by tune"),
        ({"methods": {"A": {"space": {"model.local.steps": {"int": [1, 3], "when": {"model.local.lr": 0.1}}}}}}, "when must map earlier"),
        ({"test_seeds": [0]}, "test_seeds must be fresh"),
        ({"sampler": {"name": "cmaes"}}, "sampler must be {name: one of tpe, random, grid, qmc"),
    ],
)
def test_a_bad_study_is_refused_in_one_line(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        load_study(write_study(tmp_path, **changes))


def test_unequal_budgets_are_refused_before_any_trial_unless_allowed(tmp_path, capsys):
    methods = {"A": {}, "B": {"trials": 2}}
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--config", str(write_study(tmp_path, methods=methods)), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "the methods' budgets differ (A: 4 trials x 2 rounds x 3 clients per round = 24 client-rounds; B: 2 trials" in error
    assert not (tmp_path / "out").exists()
    from fl_lightning.experiments.tune_report import budgets

    lines = budgets(load_study(write_study(tmp_path, methods=methods, unequal_budgets=True)), tmp_path / "out")
    assert lines[0] == "[tune] UNEQUAL budgets (unequal_budgets: true):"
    with pytest.raises(ValueError, match="would be the test set"):
        budgets(load_study(write_study(tmp_path, base=str(tmp_path / "plain.yaml"))), tmp_path / "out") if (
            (tmp_path / "plain.yaml").write_text(yaml.safe_dump(BASE))) else None


def test_best_so_far_and_the_config_of_dotted_keys():
    assert best_so_far([None, 0.2, 0.1, None, 0.5], maximize=True) == [None, 0.2, 0.2, 0.2, 0.5]
    assert best_so_far([0.3, 0.1, 0.2], maximize=False) == [0.3, 0.1, 0.1]
    assert nested({"model.algorithm": {"class_path": "X"}, "model.algorithm.init_args.mu": 0.1, "trainer.max_steps": 2}) == {
        "model": {"algorithm": {"class_path": "X", "init_args": {"mu": 0.1}}}, "trainer": {"max_steps": 2}}


def test_the_shipped_study_and_its_defaults_sweep_load():
    from fl_lightning.experiments.sweep import load_sweep

    root = Path(__file__).resolve().parents[1] / "configs"
    study = load_study(root / "tune_digits_study.yaml")
    assert len(study.methods) == 6 and {m.trials for m in study.methods.values()} == {20} and study.test_seeds == [100, 101, 102]
    assert set(load_sweep(root / "tune_digits_defaults.yaml").runs) == set(study.methods)
