"""Compression's defaults do not wreck accuracy: FedAvg with QSGD(levels=4) uploads on the quickstart,
every other setting left at its default, ends near the uncompressed run (docs/compression.md, "Error
feedback"; docs/algorithms.md (24.6)).

Under the former default (error feedback on for every compressor) QSGD's uploads were sent as
C/(1 + omega), 1 + omega up to 46 for the quickstart CNN's largest tensor: after 30 rounds 0.170 val
accuracy against 0.852 without error feedback (0.785 uncompressed).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from fl_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 20
MARGIN = 0.1
"""Final test accuracy of the QSGD run at most this far below the uncompressed run's. Measured after 20 rounds:
0.721 with QSGD against 0.688 uncompressed; the former default (error feedback on) gave 0.086 and fails this test."""


def _final_test_acc(tmp_path: Path, monkeypatch, name: str, *args: str) -> float:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fl-lightning"])
    root = tmp_path / name
    main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", str(ROUNDS),
          "--trainer.val_check_interval", str(ROUNDS), "--trainer.enable_progress_bar", "false",
          "--trainer.default_root_dir", str(root), *args])  # fmt: skip
    rows = list(csv.DictReader(open(next(root.glob("version_0/metrics.csv")))))
    return float([r for r in rows if r.get("test/acc")][-1]["test/acc"])


def test_qsgd_uploads_with_default_settings_reach_the_uncompressed_accuracy(tmp_path, monkeypatch):
    plain = _final_test_acc(tmp_path, monkeypatch, "none")
    qsgd = _final_test_acc(tmp_path, monkeypatch, "qsgd", "--model.compression.up", "QSGD", "--model.compression.up.levels", "4")
    assert plain > 0.5, plain  # the reference itself learned
    assert qsgd >= plain - MARGIN, f"QSGD(levels=4) uploads with default settings: test acc {qsgd:.4f}, uncompressed {plain:.4f}"
