"""The per-round record of the clients a selecting rule (Krum, Multi-Krum, Bulyan) kept:
``robust_kept.csv`` in the run's log directory, one row ``round,kept`` per round (the kept client ids,
space-separated). A resumed run drops the rows of rounds past its checkpoint before appending."""

from __future__ import annotations

from fl_lightning.core.round_csv import RoundCsv

FILE = "robust_kept.csv"


class KeptRecord(RoundCsv):
    def __init__(self, log_dir: str | None) -> None:
        super().__init__(log_dir, FILE, ("round", "kept"))

    def add(self, round_idx: int, kept: list[int]) -> None:
        self.append([{"round": round_idx, "kept": " ".join(map(str, kept))}])

    def rows(self) -> list[tuple[int, list[int]]]:
        """``(round, kept ids)`` of every recorded round."""
        return [(int(r["round"]), [int(c) for c in r["kept"].split()]) for r in self.records()]
