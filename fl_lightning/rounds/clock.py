"""Simulated time as a round stage (docs/time.md; docs/algorithms.md, (27.4)): each selected client's
online time and the steps it may run before the deadline, the deadline's cut of the cohort, and the
round's end from the bytes each reporting client sent."""

from __future__ import annotations

import logging
from typing import Any

from fl_lightning.clock import SimClock
from fl_lightning.clock.rounds import RoundTimes, plan_round, round_end
from fl_lightning.core.metrics import payload_bytes
from fl_lightning.rounds.stage import SHAPE, Cohort, Round, RoundStage

log = logging.getLogger(__name__)


class SimulatedTime:
    """The simulated seconds since the run began and the clock's nominal upload size; shared by the
    synchronous stage and the asynchronous driver."""

    def __init__(self, clock: SimClock, algorithm: Any, compression: Any) -> None:
        self.clock, self.algorithm, self.compression = clock, algorithm, compression
        self.sim_time = 0.0
        self._upload_size: int | None = None

    def nominal_upload(self, x) -> int:
        """The upload's bytes as the clock times it (fl_lightning/clock/sizes.py), computed once."""
        if self._upload_size is None:
            from fl_lightning.clock.sizes import nominal_upload_bytes

            self._upload_size = nominal_upload_bytes(self.algorithm, x, self.compression)
        return self._upload_size


class ClockStage(RoundStage):
    """``model.clock`` on synchronous rounds: rounds wait for their slowest client or the deadline."""

    name = "clock"
    order = SHAPE + 5  # after the downlink stages (the broadcast's encoded size) and the faults (a deadline cuts their budgets)
    setting = "model.clock"

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.time.clock)

    def __init__(self, time: SimulatedTime) -> None:
        self.time = time
        self._times: RoundTimes | None = None

    def _bytes_down(self, round: Round) -> int:
        return payload_bytes(round.broadcast) if round.broadcast_bytes is None else round.broadcast_bytes

    def on_broadcast(self, round: Round) -> None:
        """Each selected client's online time and the steps it may run before the deadline (27.4)."""
        clock, clients, steps = self.time.clock, round.plan.clients.tolist(), round.full_steps
        devices = clock.devices(round.num_clients)
        up = self.time.nominal_upload(round.x)
        self._times = plan_round(clock, devices, self.time.sim_time, clients, steps, self._bytes_down(round), up)

    def shape_cohort(self, round: Round | None, cohort: Cohort) -> None:
        if round is None or cohort.warmup:
            return
        allowed, keep = self._times.allowed, []
        for i, cid in enumerate(cohort.client_ids):
            if allowed[cid] < cohort.budgets[i]:
                if not allowed[cid]:
                    log.info("round %d: client %d misses the deadline (never reports)", round.plan.round, cid)
                    continue
                cohort.budgets[i] = allowed[cid]
            keep.append(i)
        cohort.keep(keep)

    def on_results(self, round: Round) -> None:
        """Move the clock to the round's end (27.4) from the bytes each reporting client actually sent."""
        results, times, clock = round.results, self._times, self.time.clock
        sizes = round.summed.upload_bytes if round.summed is not None else results.upload_bytes
        reported = list(zip(results.client_ids, results.num_steps, sizes))
        devices = clock.devices(round.num_clients)
        missed = bool(times.cut or times.missed)
        self.time.sim_time = round_end(clock, devices, self.time.sim_time, times, reported, self._bytes_down(round), missed)
        round.metrics["time/sim_s"] = self.time.sim_time
        if clock.deadline is not None:
            round.metrics.update({"faults/deadline_dropped": times.missed, "faults/deadline_stragglers": times.cut})

    def checkpoint(self) -> dict[str, Any]:
        return {"clock": {"sim_time": self.time.sim_time}}

    def restore(self, saved: dict[str, Any]) -> None:
        if "clock" in saved:
            self.time.sim_time = float(saved["clock"]["sim_time"])

