"""A synchronous round under the clock (docs/algorithms.md, (27.4)): who meets the deadline, and when the round ends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fl_lightning.clock.clock import SimClock
from fl_lightning.clock.devices import Devices


@dataclass(frozen=True)
class RoundTimes:
    """Each selected client's online time, its full K_i and the local steps it may run (0: it misses the deadline)."""

    start: dict[int, float]
    allowed: dict[int, int]
    steps: dict[int, int]

    @property
    def missed(self) -> int:
        """Clients that miss the deadline (run no step)."""
        return sum(a == 0 for a in self.allowed.values())

    @property
    def cut(self) -> int:
        """Clients that run some but not all of their K_i steps (deadline stragglers)."""
        return sum(0 < a < self.steps[c] for c, a in self.allowed.items())


def plan_round(clock: SimClock, devices: Devices, now: float, clients: Sequence[int], steps: Sequence[int],
               bytes_down: float, bytes_up: float) -> RoundTimes:  # fmt: skip
    """Before training: with a deadline D, client i runs all its K_i steps if it finishes by now + D, else
    (``straggler``) the steps that fit or (``dropout``) none."""
    start, allowed, full = {}, {}, dict(zip(clients, steps))
    for cid, k in full.items():
        start[cid] = devices.next_online(cid, now)
        allowed[cid] = k
        if clock.deadline is None:
            continue
        left = now + clock.deadline - start[cid]
        if clock.task_seconds(devices, cid, k, bytes_down, bytes_up) <= left:
            continue
        fit = clock.steps_within(devices, cid, left, bytes_down, bytes_up) if clock.deadline_action == "straggler" else 0
        allowed[cid] = max(0, min(k, fit))
    return RoundTimes(start, allowed, full)


def round_end(clock: SimClock, devices: Devices, now: float, times: RoundTimes, reported: Sequence[tuple[int, int, float]],
              bytes_down: float, missed: bool) -> float:  # fmt: skip
    """The round's end: its slowest reporting client's finish (``reported``: (client, steps run, bytes up)),
    or now + D where a client missed the deadline D."""
    finish = [times.start[c] + clock.task_seconds(devices, c, k, bytes_down, up) for c, k, up in reported]
    end = max(finish, default=now)
    if missed and clock.deadline is not None:
        end = max(end, now + clock.deadline)
    return end if math.isfinite(end) else now
