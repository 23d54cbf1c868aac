"""The asynchronous server's clients in flight, ordered by simulated finish time (docs/algorithms.md, (27.5)).

A client is sent the current model version when it is dispatched; the version's tensors are stored
once and referenced by every client in flight from it (dropped when none is), so memory grows with
the number of distinct versions in flight, not with the number of clients.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np

from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import derive_seed

DISPATCH_STREAM = 0xA5C1
"""Seed stream of a dispatch's draws: (seed, dispatch index, stream) -> the client and its tie-break."""


@dataclass(frozen=True, order=True)
class InFlight:
    """One client task in flight; ordered by (finish, tie-break, dispatch index)."""

    finish: float
    tiebreak: float
    index: int  # the dispatch's number in the run
    client: int
    version: int  # the server version (global step) it was sent
    steps: int
    start: float


def dispatch_draw(seed: int, index: int, num_clients: int, busy: set[int]) -> tuple[int, float]:
    """(client, tie-break) of dispatch ``index``: a uniform choice among the idle clients (those not in
    ``busy``, in ascending id order), then a uniform tie-break in [0, 1), from one generator seeded by
    (seed, index, DISPATCH_STREAM). Costs O(|busy|), not O(N)."""
    rng = np.random.default_rng(derive_seed(seed, index, DISPATCH_STREAM))
    client = int(rng.integers(num_clients - len(busy)))  # the k-th idle client: skip every busy id at or below it
    for b in sorted(busy):
        if b > client:
            break
        client += 1
    return client, float(rng.random())


class EventQueue:
    """Clients in flight (a heap by finish time), the model versions they reference, and the dispatch count."""

    def __init__(self) -> None:
        self.heap: list[InFlight] = []
        self.versions: dict[int, TensorDict] = {}
        self.dispatched = 0

    def busy(self) -> set[int]:
        return {e.client for e in self.heap}

    def push(self, event: InFlight, x: TensorDict) -> None:
        if event.version not in self.versions:
            self.versions[event.version] = {k: v.detach().clone() for k, v in x.items()}
        heapq.heappush(self.heap, event)
        self.dispatched += 1

    def pop(self) -> InFlight:
        return heapq.heappop(self.heap)

    def release(self, kept: Sequence[InFlight] = ()) -> None:
        """Drop the versions no client in flight (nor in ``kept``) references."""
        used = {e.version for e in self.heap} | {e.version for e in kept}
        for v in [v for v in self.versions if v not in used]:
            del self.versions[v]

    def state_dict(self) -> dict:
        return {
            "in_flight": [list(astuple(e)) for e in sorted(self.heap)],
            "versions": {str(v): dict(x) for v, x in self.versions.items()},
            "dispatched": self.dispatched,
        }

    def load_state_dict(self, state: dict) -> None:
        self.heap = [InFlight(float(f), float(t), int(i), int(c), int(v), int(k), float(s)) for f, t, i, c, v, k, s in state["in_flight"]]
        heapq.heapify(self.heap)
        self.versions = {int(v): dict(x) for v, x in state["versions"].items()}
        self.dispatched = int(state["dispatched"])
