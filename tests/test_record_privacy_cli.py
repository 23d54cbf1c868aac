"""Record-level DP-SGD from the command line: configs/dpsgd_digits.yaml logs privacy/record_epsilon every round
(the accountant's value for the steps the clients ran, against the exact RDP integrated numerically); bad settings stop before
training with one line, exit 2."""

from __future__ import annotations

import csv

import pytest

from tests.test_cli import ROOT, assert_refused_in_one_line, run_fl_lightning
from tests.test_privacy_accounting import poisson_reference

CONFIG = str(ROOT / "configs" / "dpsgd_digits.yaml")
SMALL = ["--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false",
         "--model.local.steps", "3"]  # fmt: skip


def test_dpsgd_config_logs_the_record_epsilon_every_round(tmp_path):
    """With one sampling rate q for every client, the worst client is the one that ran the most steps: after
    each round the logged epsilon is the exact RDP's epsilon of 3 m steps (within 1 % above it), m the rounds that
    client took part in."""
    q, sigma, delta = 0.25, 1.0, 1e-5
    proc = run_fl_lightning("fit", "--config", CONFIG, *SMALL, "--model.record_privacy.init_args.sampling_rate", str(q), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "runs" / "dpsgd_digits" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["privacy/record_epsilon"]]
    assert [float(r["round"]) for r in rows] == [0.0, 1.0, 2.0, 3.0]
    previous = 0.0
    for r in rows:
        steps = int(float(r["privacy/record_steps_max"]))
        assert steps % 3 == 0 and 3 <= steps <= 3 * (int(float(r["round"])) + 1)
        exact = poisson_reference(q, sigma, steps, delta)
        assert exact * (1 - 1e-6) <= float(r["privacy/record_epsilon"]) <= exact * 1.01  # (logged as float32)
        assert float(r["privacy/record_epsilon"]) >= previous
        previous = float(r["privacy/record_epsilon"])
    assert float(rows[0]["privacy/record_epsilon_min"]) == 0.0  # 5 of 20 clients trained in round 0


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--model.record_privacy.init_args.noise_multiplier", "-1", "record_privacy.noise_multiplier must be >= 0"),
        ("--model.algorithm", "fl_lightning.algorithms.FedDecorr", "record_privacy: FedDecorr does not declare record_level_dp"),
    ],
)
def test_bad_record_privacy_settings_exit_2_with_one_line(tmp_path, flag, value, message):
    """(The other constructor checks and refusals exit 2 through the same mapping: test_record_privacy.py checks their lines.)"""
    proc = run_fl_lightning("fit", "--config", CONFIG, *SMALL, flag, value, cwd=tmp_path)
    assert_refused_in_one_line(proc, message, tmp_path / "runs" / "dpsgd_digits" / "version_0")


def test_dpsgd_config_with_stragglers_stacks_every_round(tmp_path, monkeypatch):
    """configs/dpsgd_digits.yaml (batched) with half of the clients stragglers: clients of unequal steps run stacked,
    their padded steps masked (no round falls back to sequential), and each client's accountant counts its own steps."""
    from fl_lightning.commands.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", CONFIG, *SMALL, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                     "--model.faults.straggler", "0.5"])  # fmt: skip
    stats, executor = cli.model.executor.stats, cli.model.executor
    assert stats["rounds"] == stats["stacked_rounds"] == 2 and stats["padded_work"] > 0 and not executor.fallbacks
    steps = cli.model.record_privacy.accountant.steps
    assert len(set(steps[steps > 0].tolist())) > 1  # stragglers: unequal steps, each client's own accounted
