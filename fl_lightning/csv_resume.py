"""A resume into an existing CSV log (the same logger version) continues it.

Lightning's CSV writer deletes an existing ``metrics.csv`` when it starts; the rows are read
first (``read``) and, once the resumed step is known, the rows of the rounds before it are
written back (``continue_from``): rows logged after the checkpoint, before the run stopped,
are dropped and logged again by the resumed rounds, so no round is missing or doubled.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

Rows = dict[str, tuple[list[str], list[dict[str, str]]]]


def _csv_loggers(loggers: Sequence[Any]) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger

    return [logger for logger in loggers if isinstance(logger, CSVLogger)]


def read(loggers: Sequence[Any]) -> Rows:
    """``{metrics.csv path: (header, rows)}`` of the CSV loggers whose file exists and is not yet opened."""
    previous: Rows = {}
    for logger in _csv_loggers(loggers):
        path = os.path.join(logger.log_dir, "metrics.csv")
        if getattr(logger, "_experiment", None) is None and os.path.isfile(path):
            with open(path, newline="") as file:
                reader = csv.DictReader(file)
                previous[path] = (list(reader.fieldnames or []), list(reader))
    return previous


def continue_from(loggers: Sequence[Any], previous: Rows, step: int) -> None:
    """Write back the rows of steps before ``step`` into each logger's (new) metrics file."""
    for logger in _csv_loggers(loggers):
        path = os.path.join(logger.log_dir, "metrics.csv")
        if path not in previous:
            continue
        header, rows = previous.pop(path)
        kept = [row for row in rows if row.get("step", "").isdigit() and int(row["step"]) < step]
        writer = logger.experiment
        with open(writer.metrics_file_path, "w", newline="") as file:
            out = csv.DictWriter(file, fieldnames=header)
            out.writeheader()
            out.writerows(kept)
        writer.metrics_keys = list(header)
