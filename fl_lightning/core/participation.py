"""Who is active in a round and with what aggregation weight.

Every random choice derives from ``(seed, round)`` for the sampled set and from
``(seed, round, client)`` for a client's local randomness, so a round can be
replayed exactly after a resume or on another process.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from fl_lightning.core.capabilities import declared

_SAMPLING_STREAM = 0x5A3


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys, well mixed (numpy SeedSequence).

    The keys reach SeedSequence as the uint32 words it would split them into itself
    (``_uint32_words``): the same entropy, at half the cost of its conversion of a list of
    Python ints (a round derives one seed per active client).
    """
    words = np.array([word for key in keys for word in _uint32_words(int(key))], dtype=np.uint32)
    return int(np.random.SeedSequence(words).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx), all arithmetic modulo 2**32.
_POOL_SIZE = 4
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT = np.uint32(0xCA01F9DD), np.uint32(0x4973F715), np.uint32(16)
_MASK32 = 0xFFFFFFFF
_VECTORISE_FROM = 16  # rows from which derive_seeds mixes all rows at once rather than calling derive_seed per row


def _uint32_words(key: int) -> list[int]:
    """A key's entropy words as SeedSequence takes them: 32-bit little-endian words, ``[0]`` for 0."""
    if key < 0:
        raise ValueError(f"seed keys must be non-negative, got {key}")
    words = []
    while True:
        words.append(key & _MASK32)
        key >>= 32
        if not key:
            return words


def _seed_words(entropy: np.ndarray) -> np.ndarray:
    """``SeedSequence(words).generate_state(2, uint32)`` for every row of ``entropy`` (uint32 ``[R, L]``, L >= 1)."""
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * np.uint32(hash_const)
        return value ^ (value >> _XSHIFT)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = _MIX_MULT_L * x - _MIX_MULT_R * y
        return result ^ (result >> _XSHIFT)

    rows, length = entropy.shape
    zeros = np.zeros(rows, dtype=np.uint32)
    pool = [hashmix(entropy[:, i] if i < length else zeros) for i in range(_POOL_SIZE)]
    for i_src in range(_POOL_SIZE):
        for i_dst in range(_POOL_SIZE):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(_POOL_SIZE, length):
        for i_dst in range(_POOL_SIZE):
            pool[i_dst] = mix(pool[i_dst], hashmix(entropy[:, i_src]))
    out, hash_const = [], _INIT_B
    for word in pool[:2]:
        word = word ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_B) & _MASK32
        word = word * np.uint32(hash_const)
        out.append(word ^ (word >> _XSHIFT))
    return np.stack(out, axis=1)


def derive_seeds(*keys: int | Sequence[int] | np.ndarray | Tensor) -> np.ndarray:
    """``derive_seed`` of many key tuples at once, bit for bit: int64 ``[R]``.

    Each key is an int (the same in every tuple) or a 1-D sequence of R non-negative ints
    (row r takes its r-th entry). ``derive_seeds(seed, round, clients)[i] ==
    derive_seed(seed, round, clients[i])``: numpy's SeedSequence mixing, vectorised over rows.
    """
    columns, rows = [], None
    for key in keys:
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            columns.append(int(key))
            continue
        values = key.numpy() if isinstance(key, Tensor) else np.asarray(key)
        if values.ndim != 1 or not (values.dtype.kind in "iu" or values.size == 0):
            raise ValueError(f"derive_seeds keys are ints or 1-D sequences of ints, got {values.dtype} of shape {values.shape}")
        if rows is not None and len(values) != rows:
            raise ValueError(f"derive_seeds key sequences differ in length ({rows} and {len(values)})")
        rows = len(values)
        if values.size and values.min() < 0:
            raise ValueError(f"seed keys must be non-negative, got {int(values.min())}")
        columns.append(values.astype(np.uint64))
    if rows is None:
        return np.array([derive_seed(*columns)], dtype=np.int64)
    if rows == 0:
        return np.zeros(0, dtype=np.int64)
    if rows < _VECTORISE_FROM:  # the vectorised mixing costs a fixed ~0.1 ms; a call of derive_seed ~10 us
        return np.array([derive_seed(*(k if isinstance(k, int) else int(k[r]) for k in columns)) for r in range(rows)], np.int64)
    # A key >= 2**32 is two entropy words: rows are grouped by which of their keys are.
    wide = np.stack([c >= np.uint64(1 << 32) if isinstance(c, np.ndarray) else np.zeros(rows, bool) for c in columns], axis=1)
    pattern = wide @ (1 << np.arange(len(columns), dtype=np.int64)) if wide.any() else None
    result = np.empty(rows, dtype=np.int64)
    for code in [0] if pattern is None else np.unique(pattern):
        at = np.arange(rows) if pattern is None else np.nonzero(pattern == code)[0]
        words = []
        for j, column in enumerate(columns):
            if isinstance(column, int):
                words += [np.full(len(at), w, dtype=np.uint32) for w in _uint32_words(column)]
            else:
                values = column[at]
                words.append((values & np.uint64(_MASK32)).astype(np.uint32))
                if (int(code) >> j) & 1:
                    words.append((values >> np.uint64(32)).astype(np.uint32))
        state = _seed_words(np.stack(words, axis=1)).astype(np.uint64)
        result[at] = ((state[:, 0] | (state[:, 1] << np.uint64(32))) >> np.uint64(1)).astype(np.int64)
    return result


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


@dataclass(frozen=True)
class RoundInfo:
    """Facts about the current round that rules may depend on (fixed when the round starts)."""

    round: int
    local_lr: float  # this round's eta_l (after the schedule)
    num_clients: int  # N, the population size
    plan: RoundPlan | None = None  # the round's selected clients and seeds (e.g. to draw a subset of them)
    personal_lr: float | None = None  # this round's gamma_v for personal tensors (None: local_lr)


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
        seeds = torch.from_numpy(derive_seeds(seed, round_idx, clients))  # derive_seed(seed, round_idx, c) of each client
        return RoundPlan(round=round_idx, clients=clients, weights=weights.double(), seeds=seeds)

    def plans(self, first_round: int, count: int, client_sizes: Tensor, seed: int) -> Iterator[RoundPlan]:
        """``plan`` of rounds ``first_round .. first_round + count - 1``, equal to it bit for bit.

        A participation whose ``sample`` is a pure function of the round and its generator declares
        ``pure_sampling = True`` (``fl_lightning.core.capabilities``): its plans are drawn ahead in blocks, with
        the rounds' and clients' seeds derived by one vectorised call each (a plan's seed derivations are
        most of its cost). Any other participation (its ``sample`` may read state that changes during the
        run, or it overrides ``plan``) is planned round by round, when the iterator reaches the round.
        """
        rounds = range(first_round, first_round + count)
        if type(self).plan is not Participation.plan or not declared(self, "pure_sampling", ("sample",)):
            return (self.plan(r, client_sizes, seed) for r in rounds)
        sampling_seeds = derive_seeds(seed, np.arange(first_round, first_round + count, dtype=np.int64), _SAMPLING_STREAM)
        drawn = [self.sample(r, client_sizes, torch.Generator().manual_seed(int(s))) for r, s in zip(rounds, sampling_seeds.tolist())]
        round_of = torch.cat([torch.full((len(clients),), r, dtype=torch.int64) for r, (clients, _) in zip(rounds, drawn)])
        seeds = torch.from_numpy(derive_seeds(seed, round_of, torch.cat([clients for clients, _ in drawn])))
        plans, start = [], 0
        for r, (clients, weights) in zip(rounds, drawn):
            plans.append(RoundPlan(round=r, clients=clients, weights=weights.double(), seeds=seeds[start : start + len(clients)].clone()))
            start += len(clients)
        return iter(plans)


class UniformSampling(Participation):
    """Sample ``clients_per_round`` of the N clients uniformly without replacement.

    Its ``sample`` reads only the round's generator and the clients' sizes (``pure_sampling``: plans
    are drawn ahead in blocks, see ``Participation.plans``).

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

    pure_sampling = True

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


# ---- independent (Bernoulli) activation with per-client probabilities --------------------------------
_PROBABILITY_STREAM = 0x9B0


def _check_probabilities(p: Tensor, num_clients: int, setting: str) -> Tensor:
    """``p`` as a float64 vector of length N with every entry in (0, 1], else ``ValueError`` naming ``setting``."""
    p = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    if p.numel() == 1 and num_clients > 1:
        p = p.expand(num_clients).clone()
    if p.numel() != num_clients:
        raise ValueError(f"{setting} has {p.numel()} activation probabilities but num_clients={num_clients}; give one per client")
    bad = ~((p > 0) & (p <= 1))  # also catches NaN
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{setting}: activation probability of client {i} is {float(p[i])}; each must be in (0, 1]")
    return p


class ActivationProbabilities(ABC):
    """Per-client activation probabilities p_n^k of round k (a vector of length N)."""

    def validate(self, num_clients: int) -> None:
        _check_probabilities(self(0, num_clients), num_clients, type(self).__name__)

    @abstractmethod
    def __call__(self, round_idx: int, num_clients: int) -> Tensor: ...


class FixedProbabilities(ActivationProbabilities):
    """The same given probabilities every round: one per client, or one value for all.

    Args:
        values: p_n for n = 0..N-1 (or a single p for every client), each in (0, 1].
    """

    def __init__(self, values: list[float] | float) -> None:
        values = [values] if isinstance(values, (int, float)) else list(values)
        _check_probabilities(torch.tensor(values, dtype=torch.float64), len(values), "FixedProbabilities.values")
        self.values = torch.tensor(values, dtype=torch.float64)

    def __call__(self, round_idx: int, num_clients: int) -> Tensor:
        return _check_probabilities(self.values, num_clients, "FixedProbabilities.values")


class UniformRandomProbabilities(ActivationProbabilities):
    """p_n ~ U(low, high), drawn once per client from ``seed`` and then fixed for every round.

    The draw depends only on ``(seed, n)``, not on the run's seed, so Monte Carlo runs over
    the run seed share the same probabilities.

    Args:
        low, high: range, 0 < low <= high <= 1.
        seed: seed of the draw.
    """

    def __init__(self, low: float = 0.2, high: float = 0.9, seed: int = 0) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(f"UniformRandomProbabilities needs 0 < low <= high <= 1, got low={low}, high={high}")
        self.low, self.high, self.seed = low, high, seed

    def __call__(self, round_idx: int, num_clients: int) -> Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, _PROBABILITY_STREAM))
        u = torch.rand(num_clients, generator=generator, dtype=torch.float64)
        return (self.low + (self.high - self.low) * u).clamp(min=self.low, max=self.high)


class PeriodicProbabilities(ActivationProbabilities):
    """Time-varying p_n^k = low + (high - low) * (1 + sin(2 pi k / period + phi_n)) / 2.

    Each client oscillates between ``low`` and ``high`` with period ``period`` rounds and its own
    phase phi_n ~ U(0, 2 pi) drawn from ``seed`` (e.g. devices available at different times of day).

    Args:
        low, high: range, 0 < low <= high <= 1.
        period: rounds per cycle, > 0.
        seed: seed of the phases.
    """

    def __init__(self, low: float = 0.1, high: float = 0.9, period: float = 20.0, seed: int = 0) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(f"PeriodicProbabilities needs 0 < low <= high <= 1, got low={low}, high={high}")
        if not period > 0:
            raise ValueError(f"PeriodicProbabilities period must be > 0 rounds, got {period}")
        self.low, self.high, self.period, self.seed = low, high, period, seed

    def __call__(self, round_idx: int, num_clients: int) -> Tensor:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, _PROBABILITY_STREAM))
        phase = 2 * math.pi * torch.rand(num_clients, generator=generator, dtype=torch.float64)
        wave = (1 + torch.sin(2 * math.pi * round_idx / self.period + phase)) / 2
        return (self.low + (self.high - self.low) * wave).clamp(min=self.low, max=self.high)


class BernoulliParticipation(Participation):
    """Each client n is active in round k independently with probability p_n^k (Rostami & Kia, Alg. 1 l. 4).

    The active set is a Bernoulli draw, not a fixed-size sample, and may be empty (the module then
    leaves the model unchanged). Aggregation weights are ``1 / (N p_n^k)`` (Alg. 1 line 20), which
    make the aggregate an unbiased estimate of the full-participation mean:
    ``E[sum_n 1_n^k / (N p_n^k) * d_n] = (1/N) sum_n d_n``.

    Args:
        probabilities: the p_n^k: a list with one value per client, a single value for all
            clients, or an ``ActivationProbabilities`` (random draw, time-varying schedule).
        weighting: ``"inverse_probability"`` (1/(N p), unbiased) or ``"active_mean"``
            (1/|A^k|, the biased plain average of the active clients, for comparison).
    """

    def __init__(
        self,
        probabilities: ActivationProbabilities | list[float] | float = 0.5,
        weighting: Literal["inverse_probability", "active_mean"] = "inverse_probability",
    ) -> None:
        if not isinstance(probabilities, ActivationProbabilities):
            probabilities = FixedProbabilities(probabilities)
        if weighting not in ("inverse_probability", "active_mean"):
            raise ValueError(f"BernoulliParticipation weighting must be 'inverse_probability' or 'active_mean', got {weighting!r}")
        self.probabilities = probabilities
        self.weighting = weighting

    def probabilities_at(self, round_idx: int, num_clients: int) -> Tensor:
        return _check_probabilities(
            self.probabilities(round_idx, num_clients), num_clients, f"{type(self.probabilities).__name__} (round {round_idx})"
        )

    def validate(self, num_clients: int) -> None:
        self.probabilities.validate(num_clients)

    def sample(self, round_idx: int, client_sizes: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        num_clients = len(client_sizes)
        p = self.probabilities_at(round_idx, num_clients)
        active = torch.rand(num_clients, generator=generator, dtype=torch.float64) < p
        clients = active.nonzero().reshape(-1)
        if self.weighting == "active_mean":
            return clients, torch.full((len(clients),), 1.0 / max(len(clients), 1), dtype=torch.float64)
        return clients, 1.0 / (num_clients * p[clients])


class CyclicParticipation(Participation):
    """A fixed cyclic schedule: client n belongs to group n mod ``groups`` and group t mod ``groups`` trains
    in round t, so each client takes part every ``groups`` rounds exactly (the minimum separation that
    correlated-noise mechanisms assume; ``groups=1``: every client every round). No randomness: the schedule
    is public and fixed before training (docs/privacy.md, "Without sampling").

    Args:
        groups: G >= 1, the number of groups and the rounds between a client's participations.
        weighting: ``"uniform"`` (1/|group| each) or ``"samples"`` (proportional to the clients' training-set
            sizes, normalised over the group).
    """

    pure_sampling = True

    def __init__(self, groups: int = 1, weighting: Literal["uniform", "samples"] = "uniform") -> None:
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"CyclicParticipation.groups must be an integer >= 1, got {groups!r}")
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"CyclicParticipation.weighting must be 'uniform' or 'samples', got {weighting!r}")
        self.groups, self.weighting = groups, weighting

    @property
    def separation(self) -> int:
        """Rounds between two participations of one client."""
        return self.groups

    def validate(self, num_clients: int) -> None:
        if self.groups > num_clients:
            raise ValueError(f"CyclicParticipation.groups={self.groups} exceeds num_clients={num_clients}; allowed range is 1..{num_clients}")

    def rounds_of(self, group: int, rounds: int) -> np.ndarray:
        """The rounds (of ``0 .. rounds - 1``) in which ``group`` trains."""
        return np.arange(group % self.groups, rounds, self.groups)

    def sample(self, round_idx: int, client_sizes: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        clients = torch.arange(round_idx % self.groups, len(client_sizes), self.groups)
        if self.weighting == "samples":
            sizes = client_sizes[clients].double()
            return clients, sizes / sizes.sum()
        return clients, torch.full((len(clients),), 1.0 / len(clients), dtype=torch.float64)
