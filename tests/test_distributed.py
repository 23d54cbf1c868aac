"""Clients split over 2 DDP processes (gloo, CPU) give the one-process global model."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path, devices: int) -> dict:
    out = tmp_path / f"devices{devices}.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ddp_check.py"), "--devices", str(devices), "--rounds", "3",
           "--clients-per-round", "5", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_ddp_two_processes_equal_one_process(tmp_path):
    single, ddp = _train(tmp_path, 1), _train(tmp_path, 2)
    for a, b in zip(single["params"], ddp["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
