"""Robust aggregation from the command line: configs/robust_multi_krum_digits.yaml logs the kept fraction and
writes the kept clients of every round; a bad robust setting is refused before Lightning is imported (exit 2)."""

from __future__ import annotations

import csv

from fl_lightning.robust.aggregation import RULES
from fl_lightning.run.setting_ranges import ROBUST_RULES
from tests.test_cli import ROOT, run_fl_lightning

CONFIG = str(ROOT / "configs" / "robust_multi_krum_digits.yaml")
SMALL = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
         "--model.local.steps", "2"]  # fmt: skip
RUN = ("runs", "robust_multi_krum_digits", "version_0")


def test_multi_krum_config_keeps_n_minus_f_clients_each_round(tmp_path):
    proc = run_fl_lightning("fit", "--config", CONFIG, *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path.joinpath(*RUN)
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["robust/kept_fraction"]]
    assert [float(r["robust/kept_fraction"]) for r in rows] == [0.8, 0.8, 0.8]  # 8 of 10 (f = 2)
    assert all(float(r["robust/upload_norm_mean"]) > 0 for r in rows)
    with open(run_dir / "robust_kept.csv") as f:
        kept = [(int(r["round"]), [int(c) for c in r["kept"].split()]) for r in csv.DictReader(f)]
    assert [r for r, _ in kept] == [0, 1, 2]
    assert all(len(set(ids)) == 8 and all(0 <= c < 20 for c in ids) for _, ids in kept)


def test_bad_robust_settings_are_refused_before_lightning(tmp_path):
    assert RULES == ROBUST_RULES
    proc = run_fl_lightning("fit", "--config", CONFIG, "--model.robust.f", "-1", "--model.robust.rule", "krumm", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fl-lightning: error: robust.rule must be one of " + ", ".join(RULES) + ", got 'krumm'",
        "fl-lightning: error: robust.f must be an integer >= 0, got -1",
    ]
