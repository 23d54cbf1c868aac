"""Each client's device: compute speed, link bandwidth and when it is online (docs/algorithms.md, 27).

Speeds and bandwidths are drawn once per client from log-normal distributions seeded by the clock's
own seed (so Monte Carlo runs over the run seed share the devices), or read from a trace file: a CSV
with columns ``client, speed, bandwidth`` and optionally ``windows``, the client's online intervals
as ``start-end`` pairs in seconds separated by ``;`` (repeating every ``period`` seconds).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass

import numpy as np

from fl_lightning.core.participation import derive_seed

DEVICE_STREAM = 0xC10C
"""Seed stream of the devices' draws (speeds, bandwidths, on/off phases)."""


@dataclass(frozen=True)
class Devices:
    """Per-client speed s_i (steps run in ``step_cost / s_i`` seconds), bandwidth b_i (bytes/s) and
    online windows ``windows[i]`` (``[(start, end), ...]`` within one ``period``; None: always online)."""

    speed: np.ndarray
    bandwidth: np.ndarray
    windows: list[list[tuple[float, float]]] | None = None
    period: float = math.inf

    def next_online(self, client: int, t: float) -> float:
        """The first time >= t at which ``client`` is online (27.2)."""
        if self.windows is None:
            return t
        windows = self.windows[client]
        cycle = math.floor(t / self.period) if math.isfinite(self.period) else 0
        for k in (cycle, cycle + 1):
            offset = k * self.period if math.isfinite(self.period) else 0.0
            for start, end in windows:
                if offset + end > t:
                    return max(t, offset + start)
        return math.inf


def lognormal_devices(num_clients: int, seed: int, speed_sigma: float, bandwidth: float, bandwidth_sigma: float) -> Devices:
    """s_i = exp(sigma_s z_i), b_i = bandwidth * exp(sigma_b z'_i), z, z' ~ N(0, 1) iid (27.1): medians 1 and ``bandwidth``."""
    rng = np.random.default_rng(derive_seed(seed, DEVICE_STREAM))
    z = rng.standard_normal((2, num_clients))
    return Devices(np.exp(speed_sigma * z[0]), bandwidth * np.exp(bandwidth_sigma * z[1]))


def on_off_windows(num_clients: int, seed: int, period: float, duty: float) -> list[list[tuple[float, float]]]:
    """A seeded on/off process: client i is online for ``duty * period`` seconds of every ``period``,
    from its own phase phi_i ~ U(0, period) (27.2)."""
    rng = np.random.default_rng(derive_seed(seed, DEVICE_STREAM, 1))
    phases = rng.uniform(0.0, period, num_clients)
    on = duty * period
    windows = []
    for phi in phases.tolist():
        if phi + on <= period:
            windows.append([(phi, phi + on)])
        else:  # the window wraps around the cycle's end
            windows.append([(0.0, phi + on - period), (phi, period)])
    return windows


def read_trace(path: str, num_clients: int | None) -> tuple[np.ndarray, np.ndarray, list[list[tuple[float, float]]] | None]:
    """Speeds, bandwidths and (if the file has a ``windows`` column) online windows of every client
    from a CSV trace; one line naming the file and row on a bad value. ``num_clients`` None: the file's
    own values only (checked when the clock is built; the clients against the data at fit start)."""
    if not os.path.isfile(path):
        raise ValueError(f"clock.trace {path}: no such file (a relative path in a config file is read beside the config, else in the working directory)")
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"client", "speed", "bandwidth"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"clock.trace {path} lacks the column(s) {', '.join(sorted(missing))}; needs client, speed, bandwidth[, windows]")
        has_windows = "windows" in (reader.fieldnames or [])
        for line, row in enumerate(reader, start=2):
            try:
                client, s, b = int(row["client"]), float(row["speed"]), float(row["bandwidth"])
                spans = [tuple(float(v) for v in w.split("-")) for w in (row.get("windows") or "").split(";") if w.strip()]
            except (TypeError, ValueError) as error:
                empty = [k for k in ("client", "speed", "bandwidth") if row.get(k) in (None, "")]
                why = f"no value for {', '.join(empty)}" if empty else str(error)
                raise ValueError(f"clock.trace {path} line {line}: {why}") from None
            if client < 0 or (num_clients is not None and client >= num_clients):
                raise ValueError(f"clock.trace {path} line {line}: client {client} is not in 0..{(num_clients or 1) - 1}")
            if not (s > 0 and b > 0 and math.isfinite(s) and math.isfinite(b)):
                raise ValueError(f"clock.trace {path} line {line}: speed and bandwidth must be finite and > 0, got {s}, {b}")
            if any(len(w) != 2 or not 0 <= w[0] < w[1] for w in spans):
                raise ValueError(f"clock.trace {path} line {line}: windows must be 'start-end' pairs with 0 <= start < end")
            rows.append((client, s, b, sorted(spans)))
    size = num_clients if num_clients is not None else max((r[0] for r in rows), default=-1) + 1
    speed, bandwidth = np.full(size, np.nan), np.full(size, np.nan)
    windows: list[list[tuple[float, float]]] | None = [[] for _ in range(size)] if has_windows else None
    for client, s, b, spans in rows:
        speed[client], bandwidth[client] = s, b
        if windows is not None:
            windows[client] = spans
    absent = np.nonzero(np.isnan(speed))[0]
    if len(absent) and num_clients is not None:
        raise ValueError(f"clock.trace {path} has no row for client {int(absent[0])} (one row per client 0..{num_clients - 1})")
    return speed, bandwidth, windows
