"""Simulated time: each client's device (devices), the clock's settings and a task's duration (clock),
synchronous rounds under it (rounds), upload sizes before training (sizes), and asynchronous
aggregation: FedBuff and FedAsync settings (asynchronous), staleness weights, the events in flight.

docs/algorithms.md, section 27; docs/time.md.

May import: core, pipeline, compression.
"""

from fl_lightning.clock.asynchronous import AsyncAggregation
from fl_lightning.clock.clock import SimClock
from fl_lightning.clock.devices import Devices

__all__ = ["AsyncAggregation", "Devices", "SimClock"]
