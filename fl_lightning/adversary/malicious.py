"""The run's fixed set of malicious clients (docs/algorithms.md, 26.2): drawn once from the data seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_lightning.core.participation import derive_seed

MALICIOUS_STREAM = 0xBAD
"""Seed stream of the draw: ``derive_seed(data.seed, MALICIOUS_STREAM)``."""


@dataclass(frozen=True)
class MaliciousClients:
    """The ids of the malicious clients (sorted); the same for the whole run and on every process."""

    ids: tuple[int, ...]

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._set

    @property
    def _set(self) -> frozenset[int]:
        return frozenset(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"attack.fraction must be in [0, 1), got {fraction}")


def choose_malicious(num_clients: int, seed: int, fraction: float = 0.0, clients: Sequence[int] | None = None) -> MaliciousClients:
    """``clients`` as given, or ``round(fraction * N)`` clients (at least one for ``fraction > 0``) drawn
    without replacement by ``derive_seed(seed, MALICIOUS_STREAM)``."""
    if clients is not None:
        ids = sorted(int(c) for c in clients)
        bad = [c for c in ids if not 0 <= c < num_clients]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"attack.clients must be distinct ids in [0, {num_clients}), got {list(clients)}")
        return MaliciousClients(tuple(ids))
    check_fraction(fraction)
    count = max(1, round(fraction * num_clients)) if fraction > 0 else 0
    order = torch.randperm(num_clients, generator=torch.Generator().manual_seed(derive_seed(seed, MALICIOUS_STREAM)))
    return MaliciousClients(tuple(sorted(order[:count].tolist())))
