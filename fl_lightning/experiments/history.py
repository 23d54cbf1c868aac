"""A run's logged history (CSVLogger ``metrics.csv``), cost-to-target and seed statistics.

A history is one record per round that logged anything: the training row of round
``r`` and the evaluation after it share Lightning's ``step`` and are merged, so an
evaluation record carries the round and the cumulative communication counters at
that moment. In a history ``round`` counts the rounds completed (step + 1).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ACC = "val/acc"
TEST_ACC = "test/acc"  # logged at every evaluation when the data has a validation split
ROUND = "round"
BYTES = "comm/cumulative_bytes"
UPLOADS = "comm/cumulative_client_uploads"
SIM_TIME = "time/sim_s"  # simulated seconds (a run with the clock, docs/time.md)
LEGACY_NAMES = {  # metrics.csv columns of runs logged before the names said per-round or cumulative
    "comm/bytes_total": BYTES,
    "comm/client_uploads_total": UPLOADS,
    "comm/bytes_up": "comm/round_bytes_up",
    "comm/bytes_down": "comm/round_bytes_down",
}
PER_CLIENT = "comm/per_client_total"
"""Derived: model-sized messages (up + down) per participating client, summed over rounds.

``cumulative_bytes / model_bytes / (cumulative_client_uploads / rounds)``: the "total communication
per client" of Table 1 of the parameter-tracking paper (FedAvg: 2 per round, SCAFFOLD: 4).
"""

COSTS = {  # cost-to-target measures: column -> label
    ROUND: "Total global iterations (rounds)",
    PER_CLIENT: "Total communication per client (model-sized messages)",
    UPLOADS: "Client uploads (total)",
    BYTES: "Total communication (MB)",
    SIM_TIME: "Simulated time (s)",
}


@dataclass
class History:
    """Merged per-round records of one run: ``records[i][metric] = value``."""

    records: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def from_csv(cls, path: str | Path, model_bytes: int | None = None) -> History:
        """Read a CSVLogger ``metrics.csv``; ``model_bytes`` adds the derived per-client cost."""
        merged: dict[int, dict[str, float]] = {}
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(float(row["step"]))
                record = merged.setdefault(step, {})
                for key, value in row.items():
                    if key not in ("step", "epoch") and value not in ("", None):
                        record[LEGACY_NAMES.get(key, key)] = float(value)
        last = max(merged, default=None)
        if last is not None and last - 1 in merged and all(k.startswith("test/") or k == ROUND for k in merged[last]):
            # the final test (``test_after_fit``) logs at step N, after the last round N - 1: that round's record
            merged[last - 1].update({k: v for k, v in merged.pop(last).items() if k != ROUND})
        records = []
        for step in sorted(merged):
            record = merged[step]
            record[ROUND] = float(step + 1)  # rounds completed (the logged ``round`` is the 0-based index)
            records.append(record)
        history = cls(records)
        if model_bytes:
            history.add_per_client_cost(model_bytes)
        return history

    def add_per_client_cost(self, model_bytes: int) -> None:
        for record in self.records:
            if BYTES in record and record.get(UPLOADS):
                clients_per_round = record[UPLOADS] / record[ROUND]
                record[PER_CLIENT] = record[BYTES] / model_bytes / clients_per_round

    def metrics(self) -> list[str]:
        return sorted({k for r in self.records for k in r})

    def series(self, metric: str, x: str = ROUND) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rounds, x values, metric values) of the records where ``metric`` and ``x`` are logged."""
        rows = [r for r in self.records if metric in r and x in r]
        return (
            np.array([r[ROUND] for r in rows]),
            np.array([r[x] for r in rows]),
            np.array([r[metric] for r in rows]),
        )

    def final(self, metric: str = ACC) -> float:
        values = self.series(metric)[2]
        return float(values[-1]) if len(values) else math.nan

    def best(self, metric: str = ACC) -> float:
        values = self.series(metric)[2]
        return float(values.max()) if len(values) else math.nan

    def at_best(self, select: str, report: str) -> float:
        """``report`` at the first evaluation where ``select`` is highest (e.g. test accuracy at the best validation)."""
        rows = [r for r in self.records if select in r and report in r]
        return max(rows, key=lambda r: r[select])[report] if rows else math.nan

    def last(self, column: str) -> float:
        """The last logged value of ``column`` (e.g. the budget spent)."""
        values = [r[column] for r in self.records if column in r]
        return values[-1] if values else math.nan


@dataclass(frozen=True)
class Cost:
    """Cost of reaching a target: ``value`` if reached, else the ``budget`` spent (a lower bound)."""

    reached: bool
    value: float


def cost_to_target(history: History, target: float, cost: str = ROUND, metric: str = ACC) -> Cost:
    """The ``cost`` column at the first evaluation with ``metric >= target``.

    Not reached: ``Cost(False, budget)``, the cost at the end of the run, which the
    true cost exceeds.
    """
    for record in history.records:
        if metric in record and record[metric] >= target:
            if cost not in record:
                raise ValueError(
                    f"{cost!r} is not logged at the evaluation after round {record[ROUND]:g} (set trainer.log_every_n_steps: 1)"
                )
            return Cost(True, record[cost])
    return Cost(False, history.last(cost))


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value) over seeds."""
    arr = np.asarray(values, dtype=float)
    if len(arr) == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def seed_curve(histories: Sequence[History], metric: str, x: str = ROUND) -> dict[str, np.ndarray]:
    """Curve over seeds aligned on rounds: per round the mean x, mean and std of the metric.

    Only rounds logged by every seed are kept (seeds stopped early shorten the curve).
    """
    per_seed = []
    for h in histories:
        rounds, xs, ys = h.series(metric, x)
        per_seed.append({r: (xv, yv) for r, xv, yv in zip(rounds, xs, ys)})
    common = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    xs = np.array([[s[r][0] for s in per_seed] for r in common]).reshape(len(common), len(per_seed))
    ys = np.array([[s[r][1] for s in per_seed] for r in common]).reshape(len(common), len(per_seed))
    n = len(per_seed)
    return {
        "round": np.array(common, dtype=float),
        "x": xs.mean(axis=1),
        "mean": ys.mean(axis=1),
        "std": ys.std(axis=1, ddof=1) if n > 1 else np.zeros(len(common)),
        "n": np.full(len(common), n),
    }
