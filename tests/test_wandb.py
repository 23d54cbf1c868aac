"""wandb through the LightningCLI logger setting, offline and without an account."""

from pathlib import Path

from fl_lightning.commands.cli import build_cli

ROOT = Path(__file__).resolve().parents[1]


def test_wandb_offline_run_writes_its_run_directory(tmp_path, wandb_offline):
    cli = build_cli(
        [
            "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "2",
            "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
            "--trainer.logger.offline", "true",
            "--trainer.logger.project", "fl-lightning-test",
            "--trainer.logger.save_dir", str(tmp_path),
        ],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.logger.experiment.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")), "no wandb event file written"


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_offline):
    """Issue 20: a resume continued the metrics file but started a new wandb run (a new id)."""
    import os
    import subprocess
    import sys

    import torch

    def fit(rounds, *extra):
        exe = Path(sys.executable).with_name("fl-lightning")
        proc = subprocess.run([
            str(exe), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
            "--trainer.max_steps", str(rounds), "--trainer.val_check_interval", "2",
            "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
            "--trainer.logger.offline", "true", "--trainer.logger.project", "fl-lightning-test",
            "--trainer.logger.save_dir", str(tmp_path),
            "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"), "--trainer.callbacks.save_last", "true",
            "--trainer.callbacks.every_n_train_steps", "2", *extra,
        ], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]

    fit(2)
    first = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(first) == 1
    run_id = first[0].name.rsplit("-", 1)[-1]
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["loggers"] == {"wandb_run_id": run_id}
    fit(4, "--ckpt_path", str(last))
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert {r.name.rsplit("-", 1)[-1] for r in runs} == {run_id}  # one wandb run (`wandb sync` uploads both parts)
    assert torch.load(last, weights_only=True)["global_step"] == 4
