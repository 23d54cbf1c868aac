"""Local (client) learning-rate schedules: linear warmup, cosine and step, per round."""

import csv
import math
from pathlib import Path

import pytest

from fl_lightning.commands.cli import build_cli
from fl_lightning.core.config import LocalTraining

ROOT = Path(__file__).resolve().parents[1]


def test_cosine_with_warmup_values():
    local = LocalTraining(lr=0.1, lr_schedule="cosine", warmup_rounds=2, schedule_rounds=6, min_lr=0.01)
    lrs = [local.lr_at(t) for t in range(8)]
    assert lrs[:2] == pytest.approx([0.1 / 3, 0.2 / 3])  # warmup: (t + 1) / (w + 1)
    assert lrs[2] == pytest.approx(0.1)  # the schedule starts at lr
    assert lrs[4] == pytest.approx(0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[6] == pytest.approx(0.01) and lrs[7] == pytest.approx(0.01)  # min_lr after schedule_rounds
    assert local.personal_lr_at(4) == pytest.approx(lrs[4])


def test_step_values():
    local = LocalTraining(lr=0.1, lr_schedule="step", step_rounds=3, lr_decay=0.5, warmup_rounds=1)
    assert [local.lr_at(t) for t in range(8)] == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr_schedule": "cosine"}, "local.schedule_rounds must be > local.warmup_rounds=0"),
        ({"lr_schedule": "cosine", "schedule_rounds": 3, "warmup_rounds": 3}, "local.schedule_rounds must be >"),
        ({"lr_schedule": "cosine", "schedule_rounds": 3, "min_lr": 0.5}, r"local.min_lr must be in \[0, local.lr=0.1\)"),
        ({"lr_schedule": "step"}, "local.step_rounds must be >= 1"),
        ({"warmup_rounds": 2}, "local.warmup_rounds needs lr_schedule 'cosine' or 'step'"),
        ({"lr_schedule": "step", "step_rounds": 1, "warmup_rounds": -1}, "local.warmup_rounds must be an integer >= 0"),
        ({"lr_schedule": "linear"}, "local.lr_schedule must be"),
    ],
)
def test_bad_schedules_are_rejected_with_the_setting_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalTraining(**kwargs)


def test_the_cli_trains_with_the_local_schedule(tmp_path):
    logger = '{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "%s", "name": "c"}}' % tmp_path
    cli = build_cli(
        ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
         "--trainer.logger", logger, "--model.local.lr_schedule", "cosine", "--model.local.warmup_rounds", "1",
         "--model.local.schedule_rounds", "4"],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        logged = [float(r["train/local_lr"]) for r in csv.DictReader(f) if r.get("train/local_lr")]
    expected = [cli.model.local.lr_at(t) for t in range(4)]
    assert logged == pytest.approx(expected) and expected[0] == pytest.approx(0.025) and expected[1] == pytest.approx(0.05)
