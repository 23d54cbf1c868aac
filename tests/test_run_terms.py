"""A run is reported in its own terms: an asynchronous run counts server updates (not rounds) under its own name,
a run under the clock says how much time it simulated, and the evaluation rows carry ``time/sim_s``."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("fl-lightning"))


@pytest.mark.parametrize("config, head", [("fedbuff_digits", "FedBuff (FedAvg): 3 server updates in "), ("clock_digits", "FedAvg: 3 rounds in ")])
def test_the_result_line_and_the_evaluation_rows_speak_the_runs_terms(tmp_path, config, head):
    proc = subprocess.run([CLI, "fit", "--config", config, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(head) and re.search(r" s \(\d+\.\d s simulated\)", line), line
    assert ("server update" in proc.stderr) == config.startswith("fedbuff")  # the progress bar's unit
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    evaluations = [r for r in csv.DictReader(open(metrics)) if r.get("val/acc")]
    assert evaluations and all(float(r["time/sim_s"]) > 0 for r in evaluations)


def test_compare_counts_server_updates():
    from fl_lightning.experiments.compare import result_line

    info = {"rounds": 300, "unit": "server updates", "sim_s": 41.5, "fit_seconds": 3.0}
    assert result_line("FedBuff", 0, info).endswith("300 server updates (41.5 s simulated) · 3.0 s")


def test_the_result_line_names_each_mechanism_with_all_its_settings(tmp_path):
    """A partial override of a class setting merges with the base config's (here the attack keeps the base's
    LabelFlip beside the new SignFlip): the line shows the merged settings, and the defence."""
    override = "{class_path: fl_lightning.adversary.Attack, init_args: {upload: {class_path: fl_lightning.adversary.SignFlip}}}"
    args = [CLI, "fit", "--config", "attack_label_flip_digits", "--model.attack", override, "--model.robust.rule", "median",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]  # fmt: skip
    proc = subprocess.run(args, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "· attack Attack(" in line and "data=LabelFlip(" in line and "upload=SignFlip(" in line, line
    assert "· robust Robust(" in line and "rule='median'" in line, line


def test_compare_lists_each_runs_mechanisms():
    from fl_lightning.experiments.compare import result_line

    info = {"rounds": 3, "fit_seconds": 1.0, "mechanisms": ["robust Robust(rule='median')"]}
    assert result_line("median", 0, info).endswith("3 rounds · 1.0 s · robust Robust(rule='median')")
