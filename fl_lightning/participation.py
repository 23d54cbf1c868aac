"""Who is active in a round and with what aggregation weight.

Every random choice derives from ``(seed, round)`` for the sampled set and from
``(seed, round, client)`` for a client's local randomness, so a round can be
replayed exactly after a resume or on another process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

_SAMPLING_STREAM = 0x5A3


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys, well mixed (numpy SeedSequence)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


@dataclass
class RoundPlan:
    """What one training step (= one federated round) does.

    ``weights[i]`` multiplies client ``clients[i]``'s update in the aggregate
    (uniform sampling: they sum to one).
    """

    round: int
    clients: Tensor  # int64 [S]
    weights: Tensor  # float64 [S]
    seeds: Tensor  # int64 [S], one local-randomness seed per active client


class Participation(ABC):
    """Chooses the active clients of a round and their aggregation weights."""

    @abstractmethod
    def validate(self, num_clients: int) -> None:
        """Raise ``ValueError`` naming the setting if it cannot work with ``num_clients``."""

    @abstractmethod
    def sample(self, round_idx: int, client_sizes: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Return ``(clients, weights)`` for the round."""

    def plan(self, round_idx: int, client_sizes: Tensor, seed: int) -> RoundPlan:
        generator = torch.Generator().manual_seed(derive_seed(seed, round_idx, _SAMPLING_STREAM))
        clients, weights = self.sample(round_idx, client_sizes, generator)
        seeds = torch.tensor([derive_seed(seed, round_idx, int(c)) for c in clients], dtype=torch.int64)
        return RoundPlan(round=round_idx, clients=clients, weights=weights.double(), seeds=seeds)


class UniformSampling(Participation):
    """Sample ``clients_per_round`` of the N clients uniformly without replacement.

    Args:
        clients_per_round: a count S >= 1, or a fraction in (0, 1] of the N clients.
        weighting: ``"uniform"`` (1/S each) or ``"samples"`` (proportional to the
            clients' training-set sizes, normalised over the active set).
    """

    def __init__(self, clients_per_round: int | float = 0.1, weighting: Literal["uniform", "samples"] = "uniform"):
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, (int, float)):
            raise ValueError(f"clients_per_round must be an int >= 1 or a float in (0, 1], got {clients_per_round!r}")
        if isinstance(clients_per_round, float) and not 0.0 < clients_per_round <= 1.0:
            raise ValueError(f"clients_per_round as a fraction must be in (0, 1], got {clients_per_round}")
        if isinstance(clients_per_round, int) and clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}")
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be 'uniform' or 'samples', got {weighting!r}")
        self.clients_per_round = clients_per_round
        self.weighting = weighting

    def count(self, num_clients: int) -> int:
        if isinstance(self.clients_per_round, float):
            return max(1, round(self.clients_per_round * num_clients))
        return self.clients_per_round

    def validate(self, num_clients: int) -> None:
        if self.count(num_clients) > num_clients:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} exceeds num_clients={num_clients}; "
                f"allowed range is 1..{num_clients} (or a fraction in (0, 1])"
            )

    def sample(self, round_idx: int, client_sizes: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        num_clients = len(client_sizes)
        count = self.count(num_clients)
        clients = torch.randperm(num_clients, generator=generator)[:count].sort().values
        if self.weighting == "samples":
            sizes = client_sizes[clients].double()
            return clients, sizes / sizes.sum()
        return clients, torch.full((count,), 1.0 / count, dtype=torch.float64)
