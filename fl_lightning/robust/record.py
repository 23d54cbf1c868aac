"""The per-round record of the clients a selecting rule (Krum, Multi-Krum, Bulyan) kept:
``robust_kept.csv`` in the run's log directory, one row ``round,kept`` per round (the kept client ids,
space-separated). A resumed run drops the rows of rounds past its checkpoint before appending."""

from __future__ import annotations

import csv
import os

FILE = "robust_kept.csv"


class KeptRecord:
    def __init__(self, log_dir: str | None) -> None:
        self.path = os.path.join(log_dir, FILE) if log_dir else None

    def start(self, resumed_round: int) -> None:
        """Before the first round of a fit: keep the rows of rounds before ``resumed_round`` (0: none)."""
        if self.path is None:
            return
        rows = self.rows() if resumed_round else []
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["round", "kept"])
            writer.writerows([r, " ".join(map(str, kept))] for r, kept in rows if r < resumed_round)

    def add(self, round_idx: int, kept: list[int]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", newline="") as file:
            csv.writer(file).writerow([round_idx, " ".join(map(str, kept))])

    def rows(self) -> list[tuple[int, list[int]]]:
        """``(round, kept ids)`` of every recorded round."""
        if self.path is None or not os.path.exists(self.path):
            return []
        with open(self.path, newline="") as file:
            return [(int(r["round"]), [int(c) for c in r["kept"].split()]) for r in csv.DictReader(file)]
