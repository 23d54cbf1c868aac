"""The clients' batch index matrices: the same samples as the original per-pass construction."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.federated import FederatedDataModule


def _original(indices, seed, batch_size, num_steps):  # the construction before the speed-up, kept as the reference
    generator = torch.Generator().manual_seed(seed)
    per_pass = len(indices) // batch_size
    passes = [indices[torch.randperm(len(indices), generator=generator)][: per_pass * batch_size]
              for _ in range(-(-num_steps // per_pass))]  # fmt: skip
    return (passes[0] if len(passes) == 1 else torch.cat(passes)).view(-1, batch_size)[:num_steps]


@settings(max_examples=150, deadline=None)
@given(
    clients=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 2**63 - 1)), min_size=1, max_size=5),
    batch_size=st.integers(1, 30),
    steps=st.integers(1, 12),
)
def test_step_batches_equal_original(clients, batch_size, steps):
    shared = torch.Generator()  # reseeded per client, as stacked_client_batches does
    for n, seed in clients:
        indices = torch.randperm(1000)[:n].sort().values
        if batch_size > n:
            continue
        expected = _original(indices, seed, batch_size, steps)
        for generator in (torch.Generator().manual_seed(seed), shared.manual_seed(seed)):
            got = FederatedDataModule._step_batches(indices, generator, batch_size, steps)
            assert got.shape == (steps, batch_size) and got.dtype == expected.dtype
            assert torch.equal(got, expected)


class _Clients:
    """The part of a FederatedDataModule that the index matrices read."""

    client_batch_index_matrix = FederatedDataModule.client_batch_index_matrix
    client_batch_index_matrices = FederatedDataModule.client_batch_index_matrices
    _batchable_indices = FederatedDataModule._batchable_indices
    _step_batches = staticmethod(FederatedDataModule._step_batches)
    _step_positions = staticmethod(FederatedDataModule._step_positions)

    def __init__(self, sizes):
        perm = torch.randperm(sum(sizes))
        starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        self.client_train = [perm[a:b].sort().values for a, b in zip(starts, starts[1:])]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(8, 70), min_size=1, max_size=8),
    picks=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 2**63 - 1)), min_size=1, max_size=8),
    batch_size=st.integers(1, 8),
    steps=st.integers(1, 20),
)
def test_stacked_index_matrices_equal_per_client(sizes, picks, batch_size, steps):
    data = _Clients(sizes)
    clients = [c % len(sizes) for c, _ in picks]
    seeds = [s for _, s in picks]
    expected = torch.stack([_original(data.client_train[c], s, batch_size, steps) for c, s in zip(clients, seeds)])
    got = data.client_batch_index_matrices(clients, seeds, batch_size, steps)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)
    assert torch.equal(data.client_batch_index_matrix(clients[0], seeds[0], batch_size, steps), expected[0])
