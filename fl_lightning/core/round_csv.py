"""A run's CSV of rows keyed by round, beside its metrics (the per-client record of evaluation, a robust rule's kept
clients): a fit from scratch starts it anew, a resumed fit keeps the rows of the rounds before its checkpoint and
appends, so a round re-run after a resume is recorded once."""

from __future__ import annotations

import csv
import os
from typing import Any


class RoundCsv:
    """``name`` in ``log_dir`` (None: nothing is written) with the header ``columns``, one of them ``round``."""

    def __init__(self, log_dir: str | None, name: str, columns: tuple[str, ...]) -> None:
        self.path = os.path.join(log_dir, name) if log_dir else None
        self.columns = columns

    def start(self, resumed_round: int) -> None:
        """Before the first round of a fit: keep the rows of rounds before ``resumed_round`` (0: none)."""
        if self.path is None:
            return
        kept = [r for r in self.records() if int(r["round"]) < resumed_round] if resumed_round else []
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(kept)

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Append rows (the header first if the file is new); floats as repr: they read back exactly."""
        if self.path is None or not rows:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        new = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.columns)
            if new:
                writer.writeheader()
            writer.writerows(rows)

    def records(self) -> list[dict[str, str]]:
        """Every row as written (strings)."""
        if self.path is None or not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as file:
            return list(csv.DictReader(file))
