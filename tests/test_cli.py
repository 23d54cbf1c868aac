"""The `fl-lightning` console script runs the shipped configs and resumes from last.ckpt."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run_fl_lightning(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed ``fl-lightning`` command run as a user runs it, whatever its exit code."""
    exe = Path(sys.executable).with_name("fl-lightning")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def assert_refused_in_one_line(proc: subprocess.CompletedProcess, message: str, run_dir: Path) -> None:
    """A refused setting: exit 2, one stderr line holding ``message``, no traceback, no checkpoint in ``run_dir``."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if message in line]
    assert errors and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists()


def fl_lightning(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = run_fl_lightning(*args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_quickstart_runs_through_the_cli_and_resumes(tmp_path):
    config = str(ROOT / "configs" / "quickstart.yaml")
    common = ["--trainer.val_check_interval", "2", "--trainer.callbacks.init_args.every_n_train_steps", "2",
              "--data.init_args.val_fraction", "0"]  # the rows of a run without a validation split (no final test row)
    fl_lightning("fit", "--config", config, "--trainer.max_steps", "4", *common, cwd=tmp_path)
    run = tmp_path / "runs" / "quickstart" / "version_0"
    rows = _metrics(run)
    assert max(float(r["round"]) for r in rows if r["round"]) == 3  # 0-based: rounds 0..3
    assert all(r["round"] for r in rows), "every row, training and evaluation, names its round"
    assert [float(r["val/acc"]) for r in rows if r["val/acc"]], "no evaluation logged"
    assert all(float(r["comm/round_bytes_up"]) > 0 for r in rows if r["comm/round_bytes_up"])
    assert all(float(r["time/round_s"]) > 0 for r in rows if r["time/round_s"])
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4

    proc = fl_lightning("fit", "--config", config, "--trainer.max_steps", "6", *common, "--ckpt_path", str(last), cwd=tmp_path)
    # one run, one folder: the resume continues version_0 (rounds 0-3 kept, 4-5 appended, none twice)
    assert not (tmp_path / "runs" / "quickstart" / "version_1").exists() and "dirpath" not in proc.stderr
    resumed = [(r["round"], bool(r["val/acc"])) for r in _metrics(run) if r["round"]]
    assert sorted({float(r) for r, _ in resumed}) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and len(resumed) == len(set(resumed))

    out = fl_lightning("test", "--config", config, "--ckpt_path", str(last), "--data.init_args.val_fraction", "0", cwd=tmp_path)
    assert "test/acc" in out.stdout
