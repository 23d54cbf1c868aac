"""Every SGD-family config runs end to end through the `fl-lightning fit` CLI (in process) and logs consistency."""

import csv
from pathlib import Path

import pytest

from fl_lightning.cli import build_cli

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ["fedprox", "scaffold", "feddyn", "fedsam", "fedcm", "fedmim", "fedadam", "fedyogi", "fedavgm"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_config_fits_through_the_cli(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / f"{name}_digits.yaml"
    args = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"]
    args += ["--trainer.callbacks.init_args.every_n_train_steps", "2", "--model.local.steps", "2"]
    cli = build_cli(["fit", "--config", str(config), *args])
    assert type(cli.model.algorithm).__name__.lower() == name
    assert cli.trainer.global_step == 2
    with open(tmp_path / "runs" / f"{name}_digits" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["train/consistency"]) for r in rows if r["train/consistency"]]
    assert [float(r["val/acc"]) for r in rows if r["val/acc"]]
    assert (tmp_path / "runs" / f"{name}_digits" / "version_0" / "checkpoints" / "last.ckpt").exists()
