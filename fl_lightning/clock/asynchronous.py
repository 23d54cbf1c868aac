"""FedBuff and FedAsync settings and which runs they are defined for (docs/algorithms.md, 27; docs/time.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from fl_lightning.clock.events import EventQueue
from fl_lightning.clock.staleness import staleness_weight

_SERVER_RULE = ("broadcast", "aggregate", "upload_sum", "aggregate_sum", "server_state_init", "client_state_init", "server_warmup")


def defined_asynchronously(algorithm: Any) -> bool:
    """Whether ``algorithm`` is defined asynchronously: its class declares ``asynchronous = True`` and every
    server rule it runs (broadcast, aggregate, client and server state) is written by that class or above it.
    True for FedAvg's server rule (a weighted sum of stateless clients' deltas) under any server
    optimizer (FedAdam, FedYogi, momentum) and any client rule (FedProx); SCAFFOLD and FedDyn, whose
    server state mirrors a synchronous cohort's, are not."""
    from fl_lightning.core.capabilities import declared

    return declared(algorithm, "asynchronous", _SERVER_RULE)


@dataclass
class AsyncAggregation:
    """Buffered asynchronous aggregation under the clock: one training step is one server update.

    Args:
        mode: ``fedbuff`` (Nguyen et al., 2022): update after ``buffer_size`` arrivals, each weighted
            s(tau) / buffer_size (27.6); ``fedasync`` (Xie et al., 2019): x <- (1 - alpha s) x + alpha s x_i
            on each arrival (27.8).
        concurrency: clients training at once, >= 1 (each replaced by a new one when it arrives).
        buffer_size: arrivals per FedBuff update, >= 1 (FedAsync: 1).
        staleness: s(tau): ``constant``, ``polynomial`` (1 + tau)^-exponent, or ``hinge`` (27.7).
        exponent: the polynomial's a, >= 0.
        hinge_a, hinge_b: the hinge's slope (> 0) and free staleness (>= 0).
        alpha: FedAsync's mixing weight, in (0, 1].
    """

    mode: Literal["fedbuff", "fedasync"] = "fedbuff"
    concurrency: int = 10
    buffer_size: int = 5
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    exponent: float = 0.5
    hinge_a: float = 10.0
    hinge_b: int = 4
    alpha: float = 0.6

    def __post_init__(self) -> None:
        if self.mode not in ("fedbuff", "fedasync"):
            raise ValueError(f"asynchronous.mode must be 'fedbuff' or 'fedasync', got {self.mode!r}")
        for name in ("concurrency", "buffer_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"asynchronous.{name} must be an integer >= 1, got {value!r}")
        staleness_weight(self.staleness, 0)  # the kind's one line
        if not 0 <= self.exponent < math.inf:
            raise ValueError(f"asynchronous.exponent must be >= 0, got {self.exponent!r}")
        if not 0 < self.hinge_a < math.inf or not (isinstance(self.hinge_b, int) and self.hinge_b >= 0):
            raise ValueError(f"asynchronous.hinge_a must be > 0 and hinge_b an integer >= 0, got {self.hinge_a!r}, {self.hinge_b!r}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"asynchronous.alpha must be in (0, 1], got {self.alpha!r}")

    @property
    def arrivals(self) -> int:
        """Arrivals per server update."""
        return 1 if self.mode == "fedasync" else self.buffer_size

    def weight(self, tau: int) -> float:
        """The aggregation weight of an arrival of staleness tau: s(tau) / B (FedBuff) or alpha s(tau) (FedAsync)."""
        s = staleness_weight(self.staleness, tau, self.exponent, self.hinge_a, self.hinge_b)
        return self.alpha * s if self.mode == "fedasync" else s / self.buffer_size

    def check(self, algorithm: Any, clock: Any, privacy: Any, record_privacy: Any, messages: Any, personal: Any, faults: Any) -> None:
        """One line for each combination asynchronous aggregation is not defined for, before training."""
        name = type(algorithm).__name__
        if clock is None:
            raise ValueError("model.asynchronous needs model.clock: arrivals are ordered by simulated time")
        if clock.deadline is not None:
            raise ValueError("clock.deadline applies to synchronous rounds; under model.asynchronous no round waits: remove clock.deadline")
        if faults.active:
            raise ValueError("faults.dropout/straggler are synchronous rounds' faults; under model.asynchronous use the clock's speeds and availability")
        if not defined_asynchronously(algorithm):
            raise ValueError(
                f"model.asynchronous is not defined for {name}: its server rule or server/client state (e.g. control variates) "
                "assumes a synchronous cohort; use FedAvg, FedProx or a server optimizer (FedAdam, FedYogi, FedAvgM)"
            )
        if personal:
            raise ValueError("model.asynchronous does not train personal tensors (model.personal); remove model.personal")
        if privacy is not None:
            raise ValueError(
                "model.privacy (client-level DP) is not defined under model.asynchronous: its accountant counts sampled synchronous "
                "rounds, not arrivals; remove one of them"
            )
        if record_privacy is not None:
            raise ValueError("model.record_privacy is not defined under model.asynchronous (its accountant counts synchronous rounds); remove one of them")
        if messages.broadcast_stages or messages.aggregate is not None:
            raise ValueError(
                "model.asynchronous composes with uplink compression only: a compressed broadcast (compression.down) keeps one "
                "server copy per synchronous cohort, and aggregate stages add per-round noise; remove compression.down/downlink"
            )

    def check_population(self, num_clients: int) -> None:
        if self.concurrency + self.arrivals > num_clients + 1:
            raise ValueError(
                f"asynchronous.concurrency ({self.concurrency}) + arrivals per update ({self.arrivals}) - 1 must be <= num_clients "
                f"({num_clients}): a client in flight or waiting in the buffer is not sent another task"
            )

    def events_from(self, state: dict) -> EventQueue:
        events = EventQueue()
        events.load_state_dict(state)
        return events
