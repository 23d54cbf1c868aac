"""metrics.csv is live: while a run trains round r + 1, the file already holds round r's row and the
rows of every evaluation before it (fl_lightning/reliability/csv_resume.py), not only at checkpoints."""

from __future__ import annotations

import csv
import os

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROUNDS, EVERY = 6, 2


class ReadMetrics(L.Callback):
    """At the start of each round, the rounds and evaluations metrics.csv holds on disk."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[set[int], set[int]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        path = os.path.join(trainer.logger.log_dir, "metrics.csv")
        rows = list(csv.DictReader(open(path))) if os.path.isfile(path) else []
        trained = {int(r["step"]) for r in rows if r.get("train/loss")}
        evaluated = {int(float(r["round"])) for r in rows if r.get("val/acc")}
        self.seen[trainer.global_step] = (trained, evaluated)


def test_metrics_csv_holds_every_finished_round_while_the_run_goes_on(tmp_path):
    reader = ReadMetrics()
    trainer = tiny_trainer(
        tmp_path, ROUNDS, logger=CSVLogger(tmp_path, name="live"), callbacks=[reader],  # no checkpoints: nothing else flushes
        limit_val_batches=None, val_check_interval=EVERY, check_val_every_n_epoch=None,
    )  # fmt: skip
    trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    assert sorted(reader.seen) == list(range(ROUNDS))
    for r, (trained, evaluated) in reader.seen.items():  # at round r's start: rounds 0..r-1, evaluations after rounds EVERY-1, 2*EVERY-1, ...
        assert trained == set(range(r)), (r, trained)
        assert evaluated == {e for e in range(EVERY - 1, r, EVERY)}, (r, evaluated)
