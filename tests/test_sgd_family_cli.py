"""Every SGD-family config runs end to end through the `fl-lightning fit` CLI (in process) and logs consistency."""

import csv
from pathlib import Path

import pytest

from fl_lightning.commands.cli import build_cli

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


def test_fedmim_client_history_config_sends_only_the_model(tmp_path, monkeypatch):
    """The paper's convention through the CLI: 1 model down and 1 up per client and round (not 3 + 1)."""
    monkeypatch.chdir(tmp_path)
    config = ROOT / "configs" / "fedmim_client_history_digits.yaml"
    args = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", "2", "--model.local.steps", "2"]  # fmt: skip
    cli = build_cli(["fit", "--config", str(config), *args])
    module = cli.model
    assert type(module.algorithm).__name__ == "FedMIM" and module.algorithm.history == "client"
    assert module.algorithm.alpha == [0.6, 0.3] and module.algorithm.beta == [0.9, 0.1]  # the base's settings
    model_bytes = sum(p.numel() * p.element_size() for p in module.global_params().values())
    uploads = module.comm_totals["client_uploads"]
    assert uploads > 0 and module.comm_totals["bytes_up"] + module.comm_totals["bytes_down"] == 2 * uploads * model_bytes
    assert (tmp_path / "runs" / "fedmim_client_history_digits" / "version_0" / "checkpoints" / "last.ckpt").exists()
