"""A clock trace (``clock.trace``) is read and checked when the clock is built, before anything runs, in one
line per problem; a relative path in a config file is read beside the config (as ``base:``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_lightning.clock import SimClock

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("fl-lightning"))
ROWS = "client,speed,bandwidth\n" + "".join(f"{c},{1 + c % 3},1e6\n" for c in range(20))


def test_a_missing_trace_is_one_line_when_the_clock_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"clock.trace .*nope.csv: no such file"):
        SimClock(trace=str(tmp_path / "nope.csv"))


def test_a_row_with_a_missing_field_names_the_line(tmp_path):
    (tmp_path / "t.csv").write_text("client,speed,bandwidth\n0,1.0,1e6\n3,1.0\n")
    with pytest.raises(ValueError, match=r"t.csv line 3: no value for bandwidth$"):
        SimClock(trace=str(tmp_path / "t.csv"))


def test_a_trace_beside_its_config_runs_from_another_folder(tmp_path):
    study = tmp_path / "study"
    study.mkdir()
    (study / "devices.csv").write_text(ROWS)
    (study / "mine.yaml").write_text("base: quickstart\nmodel:\n  clock:\n    trace: devices.csv\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [CLI, "fit", "--config", "study/mine.yaml", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (study / "devices.csv").unlink()
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "clock.trace devices.csv: no such file" in proc.stderr
