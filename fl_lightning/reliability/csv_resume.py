"""A resume into an existing CSV log (the same logger version) continues it.

Lightning's CSV writer keeps rows in memory until it flushes (every ``flush_logs_every_n_steps``
steps, default 100) and deletes an existing ``metrics.csv`` when it starts. So that the file is live
(a running job's ``metrics.csv`` holds every round it finished) and a run killed at any moment
(SIGKILL included) can be continued without gaps or duplicates:

- every round flushes the CSV loggers (``flush``, called by the module after logging the round; the
  rows of an evaluation, logged by Lightning, Lightning saves at once): the writer appends only the
  new rows (it rewrites the file only when a new column appears, e.g. at the first evaluation);
- every checkpoint flushes the CSV loggers first (``flush``): the rows of every round a
  checkpoint holds are on disk before the checkpoint is;
- a resume reads the rows before Lightning's writer deletes them (``read``) and, once the
  resumed step is known, writes back the rows of the rounds before it (``continue_from``): rows
  logged after the checkpoint, before the run stopped, are dropped and logged again by the
  resumed rounds. Lightning's warning that "previous log files will be deleted" is silenced for
  that folder only, since its metrics are restored.

``guard`` makes a failed write of ``metrics.csv`` (a full or read-only folder) one line naming it.
"""

from __future__ import annotations

import csv
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

from fl_lightning.core.errors import write_failure

Rows = dict[str, tuple[list[str], list[dict[str, str]]]]


def _csv_loggers(loggers: Sequence[Any]) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger

    return [logger for logger in loggers if isinstance(logger, CSVLogger)]


def read(loggers: Sequence[Any]) -> Rows:
    """``{metrics.csv path: (header, rows)}`` of the CSV loggers whose file exists and is not yet opened.

    Lightning's warning that the folder's log files will be deleted is held back: a resume writes
    the rows back (``continue_from``), any other run says that it replaced them (``replaced``)."""
    previous: Rows = {}
    for logger in _csv_loggers(loggers):
        path = os.path.join(logger.log_dir, "metrics.csv")
        if getattr(logger, "_experiment", None) is None and os.path.isfile(path):
            with open(path, newline="") as file:
                reader = csv.DictReader(file)
                previous[path] = (list(reader.fieldnames or []), list(reader))
            warnings.filterwarnings("ignore", message=f"Experiment logs directory {re.escape(logger.log_dir)} exists and is not empty")
    return previous


def replaced(previous: Rows) -> None:
    """A run that is not a resume started over a folder's ``metrics.csv``: say so (Lightning's warning, held back by ``read``)."""
    for path, (_, rows) in previous.items():
        warnings.warn(f"{path}: its {len(rows)} rows of an earlier run are replaced by this run's (not a resume of it: no checkpoint given)", stacklevel=2)


def flush(loggers: Sequence[Any]) -> None:
    """Write the CSV loggers' pending rows to ``metrics.csv`` (after every round, before a checkpoint)."""
    for logger in _csv_loggers(loggers):
        if getattr(logger, "_experiment", None) is not None:
            logger.save()


def guard(loggers: Sequence[Any]) -> None:
    """A failed write of a CSV logger's ``metrics.csv`` raises one line naming the file and the cause."""
    for logger in _csv_loggers(loggers):
        writer = logger.experiment
        if getattr(writer, "_fl_guarded", False):
            continue
        save = writer.save

        def guarded(save=save, writer=writer) -> None:
            try:
                save()
            except OSError as error:
                if error.errno is None:
                    raise
                raise write_failure(error, "metrics file", writer.metrics_file_path, after="the metrics logged so far are in memory only") from error

        writer.save, writer._fl_guarded = guarded, True


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
