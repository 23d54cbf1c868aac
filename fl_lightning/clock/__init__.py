"""Simulated time: devices, a clock, and asynchronous aggregation (docs/time.md)."""

from fl_lightning.clock.clock import SimClock
from fl_lightning.clock.devices import Devices

__all__ = ["Devices", "SimClock"]
