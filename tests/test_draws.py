"""Counter-based minibatch draws (docs/algorithms.md §29): an independent reference in plain Python
(uint64 arithmetic on ints), one client drawn alone equal to a round's clients drawn at once, and the
batches every execution mode reads."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.federated import FederatedDataModule
from fl_lightning.core import draws

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:  # SplitMix64's output function, written from its definition
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _pass(seed: int, p: int, n: int) -> list[int]:
    """Pass p of a client of n samples: positions sorted by (40-bit key, position)."""
    key = lambda j: (_mix(_mix(_mix(seed) ^ p) ^ j) >> 24, j)  # noqa: E731
    return sorted(range(n), key=key)


def _fixed_reference(seed: int, n: int, batch_size: int, steps: int) -> list[list[int]]:
    """K whole batches from consecutive passes, each pass's last n % B positions skipped."""
    per_pass, out, p = n // batch_size, [], 0
    while len(out) < steps:
        order = _pass(seed, p, n)
        out += [order[b * batch_size : (b + 1) * batch_size] for b in range(per_pass)]
        p += 1
    return out[:steps]


def _epoch_reference(seed: int, n: int, batch_size: int, epochs: int) -> list[list[int]]:
    out = []
    for p in range(epochs):
        order = _pass(seed, p, n)
        out += [order[start : start + batch_size] for start in range(0, n, batch_size)]
    return out


def test_mix_matches_the_uint64_reference_on_extreme_inputs():
    values = [0, 1, 2**31, 2**62 + 7, 2**63 - 1, 123456789]
    got = draws.mix64(np.array(values, dtype=np.uint64))
    assert [int(g) for g in got] == [_mix(v) for v in values]


@settings(max_examples=60, deadline=None)
@given(
    clients=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(1, 40), st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=6),
)
def test_shuffles_of_all_clients_equal_the_reference_and_each_client_alone(clients):
    seeds, sizes, first, count = (torch.tensor(c) for c in zip(*clients))
    got = draws.shuffles(seeds, sizes, first, count)
    expected = [j for s, n, f, c in clients for p in range(f, f + c) for j in _pass(s, p, n)]
    assert got.tolist() == expected
    alone = [draws.shuffles(torch.tensor([s]), torch.tensor([n]), torch.tensor([f]), torch.tensor([c])) for s, n, f, c in clients]
    assert torch.equal(torch.cat(alone), got)


@settings(max_examples=60, deadline=None)
@given(
    clients=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(8, 50)), min_size=1, max_size=5),
    batch_size=st.integers(1, 8),
    first=st.integers(0, 9),
    steps=st.integers(1, 12),
)
def test_fixed_steps_equal_the_reference_from_any_first_step(clients, batch_size, first, steps):
    seeds, sizes = (list(c) for c in zip(*clients))
    got = draws.fixed_steps(seeds, sizes, batch_size, first, steps)
    assert got.shape == (len(clients), steps, batch_size)
    for i, (s, n) in enumerate(clients):
        assert got[i].tolist() == _fixed_reference(s, n, batch_size, first + steps)[first:]


@settings(max_examples=60, deadline=None)
@given(
    clients=st.lists(st.tuples(st.integers(0, 2**63 - 1), st.integers(1, 40)), min_size=1, max_size=5),
    batch_size=st.integers(1, 16),
    epochs=st.integers(1, 3),
)
def test_epoch_steps_visit_every_sample_once_per_epoch_as_the_reference(clients, batch_size, epochs):
    seeds, sizes = (list(c) for c in zip(*clients))
    positions, rows = draws.epoch_steps(seeds, sizes, batch_size, epochs)
    for i, (s, n) in enumerate(clients):
        expected = _epoch_reference(s, n, batch_size, epochs)
        real = rows[i].tolist()
        assert [positions[i, k, : real[k]].tolist() for k in range(len(expected))] == expected
        assert all(r == 0 for r in real[len(expected) :])


def test_passes_are_uniform_permutations():
    """Where a position lands is uniform: over 4000 seeds, each of 8 positions takes rank 0 about 1/8 of the time."""
    seeds = torch.arange(4000, dtype=torch.int64) * 7919
    flat = draws.shuffles(seeds, torch.full((4000,), 8), torch.zeros(4000, dtype=torch.int64), torch.ones(4000, dtype=torch.int64))
    passes = flat.view(4000, 8)
    assert torch.equal(passes.sort(1).values, torch.arange(8).expand(4000, 8))
    counts = torch.bincount(passes[:, 0], minlength=8).double()
    chi2 = float(((counts - 500) ** 2 / 500).sum())
    assert chi2 < 24.3  # chi-square with 7 degrees of freedom: p = 0.001


class _Clients:
    """The part of a FederatedDataModule that the index matrices read."""

    client_batch_indices = FederatedDataModule.client_batch_indices
    client_batch_index_matrix = FederatedDataModule.client_batch_index_matrix
    client_batch_index_matrices = FederatedDataModule.client_batch_index_matrices
    client_batch_index_chunks = FederatedDataModule.client_batch_index_chunks
    num_local_steps = FederatedDataModule.num_local_steps
    _batchable_indices = FederatedDataModule._batchable_indices
    _clients_flat = FederatedDataModule._clients_flat
    _fixed_step_blocks = staticmethod(FederatedDataModule._fixed_step_blocks)
    _padded_index = FederatedDataModule._padded_index

    def __init__(self, sizes):
        perm = torch.randperm(sum(sizes))
        starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        self.client_train = [perm[a:b].sort().values for a, b in zip(starts, starts[1:])]
        self.client_sizes = torch.tensor(sizes)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(8, 70), min_size=1, max_size=8),
    picks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2**63 - 1)), min_size=1, max_size=8),
    batch_size=st.integers(1, 7),  # below every client's size (at batch_size >= n a client's step is its whole set)
    steps=st.integers(1, 20),
)
def test_stacked_index_matrices_equal_each_clients_batches(sizes, picks, batch_size, steps):
    data = _Clients(sizes)
    clients = [c % len(sizes) for c, _ in picks]
    seeds = [s for _, s in picks]
    expected = torch.stack([torch.stack(list(data.client_batch_indices(c, s, batch_size, steps))) for c, s in zip(clients, seeds)])
    got = data.client_batch_index_matrices(clients, seeds, batch_size, steps)
    assert torch.equal(got, expected)
    assert torch.equal(data.client_batch_index_matrix(clients[0], seeds[0], batch_size, steps), expected[0])
    for i, (c, s) in enumerate(zip(clients, seeds)):
        reference = torch.tensor(_fixed_reference(s, sizes[c], batch_size, steps))
        assert torch.equal(got[i], data.client_train[c][reference])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    seeds=st.lists(st.integers(0, 2**63 - 1), min_size=6, max_size=6),
    batch_size=st.one_of(st.none(), st.integers(1, 16)),
    mode=st.sampled_from(["steps", "epochs"]),
    budget=st.integers(1, 4),
    straggle=st.lists(st.integers(0, 3), min_size=6, max_size=6),
)
def test_padded_index_holds_each_clients_batches(sizes, seeds, batch_size, mode, budget, straggle):
    """Masked stacking's padded index: client i's first K_i batches of ``client_batch_indices``, every
    padded row and step a copy of the client's first sample of the step (of its first step)."""
    data = _Clients(sizes)
    clients, seeds = list(range(len(sizes))), seeds[: len(sizes)]
    steps, epochs = (budget, None) if mode == "steps" else (None, budget)
    own = [list(data.client_batch_indices(c, s, batch_size, steps, epochs)) for c, s in zip(clients, seeds)]
    num_steps = [max(1, len(b) - straggle[i]) for i, b in enumerate(own)]
    index, real = data._padded_index(clients, seeds, batch_size, steps, epochs, num_steps)
    for i, batches in enumerate(own):
        for k in range(index.shape[1]):
            if k < num_steps[i]:
                n = len(batches[k])
                assert int(real[i, k]) == n and torch.equal(index[i, k, :n], batches[k])
                assert bool((index[i, k, n:] == batches[k][0]).all())
            else:
                assert int(real[i, k]) == 0 and torch.equal(index[i, k], index[i, 0])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4), st.booleans())
def test_packed_sort_orders_keys_by_key_then_position_as_a_stable_argsort(rows, narrow):
    """Heavy ties (keys 0..3, 3 standing for the padding key) and, with ``narrow``, rows wider than the position bits
    (the stable argsort itself): the order is a Python sort by (key, position)."""
    width = max(len(r) for r in rows)
    table = np.array([[[r[j] if j < len(r) else 3 for j in range(width)]] for r in rows], dtype=np.uint64)
    table = np.where(table == 3, draws._PAD_KEY, table * np.uint64((1 << draws.KEY_BITS) // 3))
    expected = [[sorted(range(width), key=lambda j: (int(row[0][j]), j))] for row in table]
    saved = draws._POSITION_BITS
    draws._POSITION_BITS = 2 if narrow else saved
    try:
        got = draws._stable_argsort(table)
    finally:
        draws._POSITION_BITS = saved
    assert got.dtype == np.int64 and got.tolist() == expected


@pytest.mark.parametrize("split", [{}, {"holdout_fraction": 0.3}, {"holdout_fraction": 0.2, "val_fraction": 0.1, "new_client_fraction": 0.25}])
def test_a_rounds_local_steps_are_each_clients(split):
    """``clients_num_local_steps`` (sizes read in one gather) is ``num_local_steps`` client by client, for the partition's
    own indices, held-out splits and unseen clients, with repeated ids, batches of 1, above every client and none."""
    from tests.conftest import tiny_datamodule

    data = tiny_datamodule(num_clients=12, **split)
    data.setup()
    everyone = list(range(len(data.client_train)))  # unseen clients included
    ids = everyone + everyone[::-1] + [0, 0, everyone[-1]]
    assert data.clients_num_local_steps([], 4, None, 2) == []
    for batch_size, steps, epochs in [(1, None, 1), (3, None, 2), (7, None, 3), (1000, None, 1), (None, None, 2), (4, 5, None), (None, 3, None)]:
        expected = [data.num_local_steps(c, batch_size, steps, epochs) for c in ids]
        assert data.clients_num_local_steps(ids, batch_size, steps, epochs) == expected
        assert len(set(expected)) > 1 or steps is not None or batch_size in (None, 1000)
    with pytest.raises(IndexError):
        data.clients_num_local_steps([0, len(data.client_train)], 4, None, 1)
