"""The per-client record of personalized evaluation: ``clients.csv`` in the run's log directory, one row per
client, split and evaluation, appended at every evaluation (``PersonalizedEvaluation``):

``round`` (the 0-based round the evaluation follows, as ``round`` in ``metrics.csv``), ``split`` (``val``: the
validation half of the client's held-out data, ``test``: its test half), ``client``, ``samples``, ``global_acc``
(the global model), ``personal_acc`` (the model the client predicts with; the global one for a method without
personalization), ``seen`` (1: a training client, 0: an unseen one, ``data.new_client_fraction``).

A fit from scratch starts the file anew (as ``metrics.csv``); a resumed fit keeps the rows of the evaluations
before its checkpoint's step and appends; a test appends.
"""

from __future__ import annotations

import csv
import os
from typing import Any

FILE = "clients.csv"
COLUMNS = ("round", "split", "client", "samples", "global_acc", "personal_acc", "seen")


class ClientRecord:
    def __init__(self, log_dir: str | None) -> None:
        self.path = os.path.join(log_dir, FILE) if log_dir else None

    def start(self, resumed_step: int) -> None:
        """Before the first round of a fit: keep the rows of evaluations after rounds before ``resumed_step`` (0: none)."""
        if self.path is None:
            return
        kept = [r for r in self.rows() if int(r["round"]) < resumed_step] if resumed_step else []
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(kept)

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Append one evaluation's rows (the header first if the file is new)."""
        if self.path is None or not rows:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        new = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            writer.writerows(rows)  # floats as repr: the accuracies read back exactly

    def rows(self) -> list[dict[str, str]]:
        if self.path is None or not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as file:
            return list(csv.DictReader(file))
