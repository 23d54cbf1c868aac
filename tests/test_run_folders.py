"""One folder per run: logs, checkpoints and config under ``trainer.default_root_dir``, whatever the logger."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

from fl_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.val_check_interval", "2",
         "--trainer.callbacks.init_args.every_n_train_steps", "2", "--trainer.enable_progress_bar", "false"]  # fmt: skip
NOISE = ("Previous log files in this directory will be deleted", "dirpath has changed")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _main(*args: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(list(args))
    return [str(w.message) for w in caught]


def test_default_root_dir_moves_everything_and_resume_and_test_stay_in_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "elsewhere"
    _main("fit", *QUICK, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root))
    assert _files(tmp_path) == ["elsewhere/version_0/checkpoints/last.ckpt", "elsewhere/version_0/config.yaml",
                                "elsewhere/version_0/hparams.yaml", "elsewhere/version_0/metrics.csv"]  # fmt: skip
    ckpt = str(root / "version_0" / "checkpoints" / "last.ckpt")
    messages = _main("fit", *QUICK, "--trainer.max_steps", "4", "--trainer.default_root_dir", str(root), "--ckpt_path", ckpt)
    assert not [m for m in messages if any(n in m for n in NOISE)]
    config_before = (root / "version_0" / "config.yaml").read_text()
    messages = _main("test", *QUICK, "--trainer.default_root_dir", str(root), "--ckpt_path", ckpt)
    assert not [m for m in messages if any(n in m for n in NOISE)]
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]  # test opened no new version
    assert (root / "version_0" / "config.yaml").read_text() == config_before  # the config it trained with
    with open(root / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted({float(r["round"]) for r in rows if r["round"]}) == [0.0, 1.0, 2.0, 3.0]  # training rows kept
    assert rows[-1]["test/acc"] and not rows[-1]["val/acc"]  # the test appended


def test_without_a_logger_checkpoints_and_config_go_to_a_versioned_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        _main("fit", *QUICK, "--trainer.max_steps", "2", "--trainer.logger", "false")
    assert _files(tmp_path / "runs") == [f"quickstart/version_{n}/{f}" for n in (0, 1) for f in ("checkpoints/last.ckpt", "config.yaml")]
