"""Client-level DP from the command line: configs/dp_fedavg_digits.yaml logs privacy/epsilon every round
(the accountant's value for the run's events); bad settings stop before training with one line, exit 2."""

from __future__ import annotations

import csv

import pytest

from fl_lightning.core.participation import BernoulliParticipation
from fl_lightning.pipeline.privacy_accounting import SamplingScheme, epsilon_after
from tests.test_cli import ROOT, assert_refused_in_one_line, run_fl_lightning

CONFIG = str(ROOT / "configs" / "dp_fedavg_digits.yaml")
SMALL = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
         "--data.init_args.num_clients", "40", "--model.local.steps", "2"]  # fmt: skip


def test_dp_config_logs_the_accountants_epsilon_every_round(tmp_path):
    proc = run_fl_lightning("fit", "--config", CONFIG, *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "runs" / "dp_fedavg_digits" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["privacy/epsilon"]]
    assert [float(r["round"]) for r in rows] == [0.0, 1.0, 2.0]
    scheme = SamplingScheme.of(BernoulliParticipation(0.25), 40)
    for r in rows:
        expected = epsilon_after(scheme, 1.0, 1e-4, int(float(r["round"])) + 1)
        assert float(r["privacy/epsilon"]) == pytest.approx(expected, rel=1e-9)


def test_epsilon_reaches_the_progress_bar_and_the_result_line(tmp_path):
    """The terminal shows what metrics.csv logs: ``eps 1.23`` in the bar, ``epsilon 1.23 (RDP, delta 0.0001)`` in
    the closing line (dp-accounting's noisy warnings about unconverged fractional orders stay out of it)."""
    args = [a for a in SMALL if a not in ("--trainer.enable_progress_bar", "false")]
    proc = run_fl_lightning("fit", "--config", CONFIG, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = epsilon_after(SamplingScheme.of(BernoulliParticipation(0.25), 40), 1.0, 1e-4, 3)
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("FedAvg: 3 rounds in ") and f" · epsilon {expected:.2f} (RDP, delta 0.0001)" in line, line
    assert "round 3/3" in proc.stderr and f"eps {expected:.2f}" in proc.stderr
    assert "_compute_log_a_frac" not in proc.stderr


def test_a_run_stopped_by_its_budget_evaluates_its_final_model(tmp_path):
    """budget: stop after 3 of 10 rounds (evaluation every 10): the stopped run validates and tests the model it
    ends with, as a run that reaches max_steps does."""
    budget = epsilon_after(SamplingScheme.of(BernoulliParticipation(0.25), 40), 1.0, 1e-4, 3) * 1.0001
    args = [*SMALL, "--trainer.max_steps", "10", "--trainer.val_check_interval", "10"]
    budget_args = ["--model.privacy.init_args.target_epsilon", str(budget), "--model.privacy.init_args.budget", "stop"]
    proc = run_fl_lightning("fit", "--config", CONFIG, *args, *budget_args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "privacy: stopping after 3 rounds" in proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("FedAvg: 3 rounds in ") and "final val acc" in line and "(round 3)" in line, line
    assert "test acc" in line and "no evaluation" not in line, line
    with open(tmp_path / "runs" / "dp_fedavg_digits" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))  # "round" is the 0-based index of the round the metric follows
    assert [float(r["round"]) for r in rows if r.get("val/acc")] == [2.0] and any(r.get("test/acc") for r in rows)


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--model.privacy.init_args.target_epsilon", "0.001", "privacy.target_epsilon=0.001 cannot be reached in 3 rounds"),
    ],
)
def test_bad_privacy_settings_exit_2_with_one_line(tmp_path, flag, value, message):
    """(The constructor's checks, e.g. clip_norm <= 0, exit 2 through the same mapping: test_privacy.py checks their lines.)"""
    proc = run_fl_lightning("fit", "--config", CONFIG, *SMALL, flag, value, cwd=tmp_path)
    assert_refused_in_one_line(proc, message, tmp_path / "runs" / "dp_fedavg_digits" / "version_0")
