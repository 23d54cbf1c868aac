"""The simulated clock's settings and a task's duration (docs/algorithms.md, 27; docs/time.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fl_lightning.clock.devices import Devices, lognormal_devices, on_off_windows, read_trace


@dataclass
class SimClock:
    """Simulated time: every client task takes (27.3)
    ``T_i = K_i * step_cost / s_i + (bytes_down + bytes_up) / b_i`` seconds after the client is online.

    Args:
        step_cost: seconds one local step takes on a device of speed 1, > 0.
        speed_sigma: sigma of the log-normal speeds s_i = exp(sigma z_i) (median 1), >= 0; 0: all equal.
        bandwidth: median link bandwidth b in bytes per second, > 0.
        bandwidth_sigma: sigma of the log-normal bandwidths b_i = b exp(sigma z'_i), >= 0.
        trace: a CSV file with one row per client (``client, speed, bandwidth[, windows]``) replacing the draws.
        availability: ``always``; ``on_off`` (online ``duty`` of every ``period`` seconds from a seeded
            phase); ``trace`` (the trace's ``windows``, repeating every ``period``).
        period: seconds of one availability cycle (e.g. 86400 for a day), > 0.
        duty: fraction of the period a client is online under ``on_off``, in (0, 1].
        deadline: seconds a synchronous round waits, > 0; None: it waits for its slowest client.
        deadline_action: a client that would miss the deadline ``dropout`` (never reports) or ``straggler``
            (runs only the local steps that fit, at least one, else it drops out), as the faults do.
        seed: the devices' seed (fixed across Monte Carlo runs of the run seed).
    """

    step_cost: float = 0.1
    speed_sigma: float = 0.0
    bandwidth: float = 1e6
    bandwidth_sigma: float = 0.0
    trace: str | None = None
    availability: Literal["always", "on_off", "trace"] = "always"
    period: float = 86400.0
    duty: float = 0.5
    deadline: float | None = None
    deadline_action: Literal["dropout", "straggler"] = "dropout"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("step_cost", "bandwidth", "period"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"clock.{name} must be > 0 and finite, got {value!r}")
        for name in ("speed_sigma", "bandwidth_sigma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"clock.{name} must be >= 0 and finite, got {value!r}")
        if not 0 < self.duty <= 1:
            raise ValueError(f"clock.duty must be in (0, 1], got {self.duty!r}")
        if self.availability not in ("always", "on_off", "trace"):
            raise ValueError(f"clock.availability must be 'always', 'on_off' or 'trace', got {self.availability!r}")
        if self.availability == "trace" and self.trace is None:
            raise ValueError("clock.availability 'trace' needs clock.trace, a CSV with a windows column")
        if self.deadline is not None and not 0 < self.deadline < math.inf:
            raise ValueError(f"clock.deadline must be > 0 seconds (or null: wait for the slowest client), got {self.deadline!r}")
        if self.deadline_action not in ("dropout", "straggler"):
            raise ValueError(f"clock.deadline_action must be 'dropout' or 'straggler', got {self.deadline_action!r}")
        self._devices: Devices | None = None
        if self.trace is not None:  # its structure now, before anything runs; its clients against the data at fit start
            read_trace(self.trace, None)

    def devices(self, num_clients: int) -> Devices:
        """The clients' devices (drawn or read once)."""
        if self._devices is None or len(self._devices.speed) != num_clients:
            windows = None
            if self.trace is not None:
                speed, bandwidth, windows = read_trace(self.trace, num_clients)
                if self.availability == "trace" and windows is None:
                    raise ValueError(f"clock.availability 'trace' needs a windows column in clock.trace {self.trace}")
                never = [c for c, w in enumerate(windows or []) if not w]
                if self.availability == "trace" and never:
                    raise ValueError(f"clock.trace {self.trace}: client {never[0]} has no online window (its task would never end)")
            else:
                drawn = lognormal_devices(num_clients, self.seed, self.speed_sigma, self.bandwidth, self.bandwidth_sigma)
                speed, bandwidth = drawn.speed, drawn.bandwidth
            if self.availability == "on_off":
                windows = on_off_windows(num_clients, self.seed, self.period, self.duty)
            elif self.availability == "always":
                windows = None
            self._devices = Devices(speed, bandwidth, windows, self.period)
        return self._devices

    def task_seconds(self, devices: Devices, client: int, steps: int, bytes_down: float, bytes_up: float) -> float:
        """T_i of (27.3): compute plus both transfers."""
        return steps * self.step_cost / float(devices.speed[client]) + (bytes_down + bytes_up) / float(devices.bandwidth[client])

    def steps_within(self, devices: Devices, client: int, seconds: float, bytes_down: float, bytes_up: float) -> int:
        """The most local steps client ``client`` completes, transfers included, in ``seconds`` (may be <= 0)."""
        compute = seconds - (bytes_down + bytes_up) / float(devices.bandwidth[client])
        return int(np.floor(compute * float(devices.speed[client]) / self.step_cost + 1e-9))
