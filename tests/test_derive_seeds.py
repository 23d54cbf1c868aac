"""derive_seeds: numpy's SeedSequence mixing vectorised over many key tuples, bit for bit."""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_lightning.core import participation
from fl_lightning.core.participation import BernoulliParticipation, UniformSampling, derive_seed, derive_seeds

small = st.integers(0, 2**32 - 1)
any_key = st.one_of(small, st.integers(0, 2**63 - 1))  # 1 or 2 entropy words


def _reference(*keys: int) -> int:
    state = np.random.SeedSequence(list(keys)).generate_state(2, np.uint32)
    return int(state.view(np.uint64)[0] >> 1)


@settings(max_examples=200, deadline=None)
@given(
    scalars=st.lists(st.one_of(any_key, st.integers(0, 2**100)), min_size=0, max_size=3),
    columns=st.integers(1, 4).flatmap(lambda m: st.lists(st.lists(any_key, min_size=m, max_size=m), min_size=1, max_size=6)),
    data=st.data(),
)
def test_derive_seeds_equals_seed_sequence(scalars, columns, data):
    rows = len(columns[0])
    # interleave the scalar keys among the per-row key columns at drawn positions
    keys: list = [np.array(c, dtype=np.uint64) for c in columns]
    for s in scalars:
        keys.insert(data.draw(st.integers(0, len(keys))), s)
    expected = [_reference(*[k if isinstance(k, int) else int(k[r]) for k in keys]) for r in range(rows)]
    for vectorise_from in (1, 10**9):  # the vectorised mixing, and the loop of derive_seed used for few rows
        with mock.patch.object(participation, "_VECTORISE_FROM", vectorise_from):
            got = derive_seeds(*keys)
        assert got.dtype == np.int64
        assert got.tolist() == expected
    assert expected == [derive_seed(*[k if isinstance(k, int) else int(k[r]) for k in keys]) for r in range(rows)]


@settings(max_examples=50, deadline=None)
@given(seed=any_key, round_idx=small, clients=st.lists(st.integers(0, 10**6), max_size=60))
def test_round_seeds_of_clients(seed, round_idx, clients):
    with mock.patch.object(participation, "_VECTORISE_FROM", 1):
        got = derive_seeds(seed, round_idx, torch.tensor(clients, dtype=torch.int64))
    assert got.tolist() == [derive_seed(seed, round_idx, c) for c in clients]
    assert derive_seeds(seed, round_idx, torch.tensor(clients, dtype=torch.int64)).tolist() == got.tolist()


def test_plan_seeds_unchanged():
    plan = UniformSampling(7).plan(3, torch.ones(40), seed=11)
    assert plan.seeds.dtype == torch.int64
    assert plan.seeds.tolist() == [derive_seed(11, 3, c) for c in plan.clients.tolist()]


def test_edge_cases():
    assert derive_seeds(5, 9).tolist() == [derive_seed(5, 9)]
    assert derive_seeds(1, torch.zeros(0, dtype=torch.int64)).shape == (0,)
    assert derive_seeds([0, 2**32, 2**32 - 1], 0).tolist() == [derive_seed(k, 0) for k in (0, 2**32, 2**32 - 1)]
    with pytest.raises(ValueError):
        derive_seeds(1, [-1, 2])
    with pytest.raises(ValueError):
        derive_seeds([1, 2], [1, 2, 3])


class _Pure(UniformSampling):
    """A subclass that rewrites ``sample`` without declaring ``pure_sampling`` again."""

    def sample(self, round_idx, client_sizes, generator):
        return super().sample(round_idx, client_sizes, generator)


@pytest.mark.parametrize(
    "participation", [UniformSampling(7), UniformSampling(0.25, weighting="samples"), BernoulliParticipation(0.4), _Pure(5)]
)
def test_plans_ahead_equal_round_by_round_plans(participation):
    """``plans`` (blocks of rounds drawn at once where sampling is pure) equals ``plan`` of each round, bit for bit."""
    sizes = torch.arange(1, 41)
    plans = list(participation.plans(2**31 + 5, 40, sizes, seed=2**40 + 3))  # keys past 32 bits: two entropy words
    assert [p.round for p in plans] == list(range(2**31 + 5, 2**31 + 45))
    for got in plans:
        want = participation.plan(got.round, sizes, seed=2**40 + 3)
        for field in ("clients", "weights", "seeds"):
            assert getattr(got, field).dtype == getattr(want, field).dtype
            assert torch.equal(getattr(got, field), getattr(want, field)), (got.round, field)


def test_only_declared_pure_sampling_is_planned_ahead():
    """A participation that has not declared ``pure_sampling`` (its ``sample`` may read state that changes
    during the run) is planned when the iterator reaches the round, not ahead."""
    calls = []

    class Counting(BernoulliParticipation):
        def sample(self, round_idx, client_sizes, generator):
            calls.append(round_idx)
            return super().sample(round_idx, client_sizes, generator)

    class CountingUniform(UniformSampling):
        pure_sampling = True

        def sample(self, round_idx, client_sizes, generator):
            calls.append(round_idx)
            return super().sample(round_idx, client_sizes, generator)

    plans = Counting(0.5).plans(0, 8, torch.ones(10), seed=1)
    next(plans)
    assert calls == [0]
    calls.clear()
    next(CountingUniform(3).plans(0, 8, torch.ones(10), seed=1))
    assert calls == list(range(8))  # declared pure: the block drawn at once
