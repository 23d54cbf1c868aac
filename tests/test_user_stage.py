"""A user's own round stage (examples/loss_reweighting.py, shown in docs/architecture.md): loaded with
``--import`` and configured as ``model.stages`` from the CLI, sequential, batched and on 2 DDP processes."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("fl-lightning"))
STAGE = '[{class_path: loss_reweighting.LossReweighting, init_args: {power: 2.0}}]'
FIT = ["fit", "--import", "loss_reweighting", "--config", "quickstart", "--model.stages", STAGE, "--trainer.max_steps", "2",
       "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]  # fmt: skip


def _fit(tmp_path: Path, name: str, *extra: str) -> tuple[list[dict], dict]:
    shutil.copy(ROOT / "examples" / "loss_reweighting.py", tmp_path / "loss_reweighting.py")
    args = [*FIT, "--trainer.logger.init_args.name", name, "--trainer.default_root_dir", f"runs/{name}", *extra]
    proc = subprocess.run([CLI, *args], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "runs" / name / "version_0" / "metrics.csv")))
    state = torch.load(tmp_path / "runs" / name / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    return [r for r in rows if r.get("reweight/max_share")], state


def test_the_docs_show_the_example_file():
    assert (ROOT / "examples" / "loss_reweighting.py").read_text().split('"""', 2)[2].strip() in (ROOT / "docs" / "architecture.md").read_text()
    assert len((ROOT / "examples" / "loss_reweighting.py").read_text().splitlines()) <= 40


def test_the_weights_are_the_losses_to_the_power():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from loss_reweighting import LossReweighting
    finally:
        sys.path.remove(str(ROOT / "examples"))

    class Results:
        client_ids, mean_losses = [4, 1, 7], [0.5, 2.0, 1.0]

    class Round:
        results, metrics = Results(), {}

    weights = LossReweighting(power=2.0).aggregation_weights(Round())([1, 7, 4])
    assert torch.equal(weights, torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64) / 5.25)
    assert Round.metrics["reweight/max_share"] == 4.0 / 5.25
    with pytest.raises(ValueError, match="power must be >= 0"):
        LossReweighting(power=-1.0)


def test_a_user_stage_runs_from_the_cli_sequential_batched_and_ddp(tmp_path):
    sequential, seq_state = _fit(tmp_path, "seq")
    batched, bat_state = _fit(tmp_path, "bat", "--model.execution", "batched")
    ddp, ddp_state = _fit(tmp_path, "ddp", "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    assert len(sequential) == len(batched) == len(ddp) == 2
    assert all(1 / 5 < float(r["reweight/max_share"]) < 1 for r in sequential)  # 5 clients of unequal losses
    for name, value in seq_state.items():
        torch.testing.assert_close(bat_state[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ddp_state[name], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(sequential, ddp):
        assert float(a["reweight/max_share"]) == pytest.approx(float(b["reweight/max_share"]), rel=1e-5)


def test_a_user_stage_with_privacy_is_refused_in_one_line(tmp_path):
    shutil.copy(ROOT / "examples" / "loss_reweighting.py", tmp_path / "loss_reweighting.py")
    proc = subprocess.run([CLI, *FIT, "--model.privacy", "fl_lightning.pipeline.privacy.ClientPrivacy", "--model.privacy.clip_norm", "1.0",
                           "--model.privacy.noise_multiplier", "1.0"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "model.privacy with model.stages: client-level DP's noise is calibrated to fixed weights"), proc.stderr[-2000:]
