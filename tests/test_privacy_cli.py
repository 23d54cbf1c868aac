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
