"""Clients split over 2 DDP processes (gloo, CPU) give the one-process global model,
server state and client store."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning.executors.distributed import assign_clients

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path, devices: int, algorithm: str, skew: bool) -> dict:
    out = tmp_path / f"{algorithm}_devices{devices}.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ddp_check.py"), "--devices", str(devices), "--rounds", "3",
           "--clients-per-round", "5", "--algorithm", algorithm, "--out", str(out)] + ["--skew"] * skew  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


# docs/algorithms.md, E13
@pytest.mark.parametrize(
    "algorithm, skew",
    [
        ("scaffold", True),  # client state; unequal local steps, so the ranks get unequal client counts
        ("fadam_et", False),  # only the tracking subset uploads y_delta: results of two structures
        ("scaffold_p", False),  # the warm-up pass split over the ranks; personal tensors as client state
    ],
)
def test_ddp_two_processes_equal_one_process(tmp_path, algorithm, skew):
    single, ddp = _train(tmp_path, 1, algorithm, skew), _train(tmp_path, 2, algorithm, skew)
    for a, b in zip(single["params"], ddp["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    for key in ("server_state", "store"):
        assert single[key].keys() == ddp[key].keys()
        for name in single[key]:
            torch.testing.assert_close(single[key][name], ddp[key][name], rtol=0, atol=1e-7)
    assert single["store"], "the check must compare some client state"


def test_assign_clients_balances_local_steps_deterministically():
    steps = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4]
    ranks = assign_clients(steps, 2)
    assert sorted(p for r in ranks for p in r) == list(range(len(steps)))
    loads = [sum(steps[p] for p in r) for r in ranks]
    assert loads == [12, 12]  # round-robin would give 19 / 5
    assert ranks == assign_clients(steps, 2)
    assert assign_clients([3] * 5, 2) == [[0, 2, 4], [1, 3]]  # equal steps: round-robin


def test_a_fatal_error_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """A setup error raised on rank 1 only: rank 0 (the process the user started) blocked in the round's
    exchange until gloo noticed the dead peer, then ended with 'Connection closed by peer' instead of the error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_fault.py"), "--fail-rank", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    rank0 = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))
    assert "RankFailed: round 1: rank 1 failed: FatalClientError: round 1: client" in rank0, proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr


def test_a_stop_signal_seen_by_one_rank_stops_every_rank_as_a_stop(tmp_path):
    """A rank that stopped on SIGTERM during its clients' steps: the others stop as interrupted too (exit 143
    from the CLI), not as failed, and not waiting in the next round's exchange."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_fault.py"), "--fail-rank", "1", "--interrupt"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    rank0 = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))
    assert "RunInterrupted: round 1: stopped by SIGTERM on rank 1 (the round is not aggregated); no stop checkpoint under DDP" in rank0, proc.stderr[-3000:]
