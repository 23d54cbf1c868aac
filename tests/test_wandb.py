"""wandb through the LightningCLI logger setting, offline and without an account."""

from pathlib import Path

from fl_lightning.cli import build_cli

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
