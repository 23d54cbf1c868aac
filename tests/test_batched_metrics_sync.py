"""Batched execution reads a round's per-client loss and accuracy back with one host transfer, not one per
metric or client (docs/performance.md, "Per-round overhead"), with the values of a plain reference."""

import numpy as np
import pytest
import torch

from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.core.objective import StepRecord
from fl_lightning.executors import BatchedExecutor
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

K, S, B, C = 3, 4, 5, 3


def _record(seed=0):
    g = torch.Generator().manual_seed(seed)
    record = StepRecord()
    for _ in range(K):
        record.add(torch.rand(S, generator=g), torch.randn(S, B, C, generator=g), torch.randint(C, (S, B), generator=g))
    return record


class _Reads:
    """Counts the host reads of tensors (``tolist``, ``item``, ``float()``) while ``on``."""

    def __init__(self, monkeypatch):
        self.count, self.on = 0, False
        for name in ("tolist", "item", "__float__"):
            original = getattr(torch.Tensor, name)

            def spy(tensor, *args, _original=original, **kwargs):
                self.count += self.on
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, spy)


@pytest.mark.parametrize("masked", [False, True])
def test_means_match_a_plain_reference_with_one_read(monkeypatch, masked):
    record = _record()
    losses = np.stack([t.numpy() for t in record.losses]).astype(np.float64)  # [K, S]
    hits = np.stack([(o.numpy().argmax(-1) == t.numpy()) for o, t in zip(record.outputs, record.targets)])  # [K, S, B]
    if masked:
        step_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # [S, K]
        real = torch.tensor([[5, 5, 2], [3, 0, 0], [5, 4, 0], [5, 5, 5]])  # real rows of each step; padded targets never match
        for k in range(K):
            for s in range(S):
                record.targets[k][s, int(real[s, k]):] = -100
        hits = np.stack([(o.numpy().argmax(-1) == t.numpy()) for o, t in zip(record.outputs, record.targets)])
        m = step_mask.numpy().T
        want_loss = (losses * m).sum(0) / m.sum(0)
        want_acc = (hits.sum(-1) * m).sum(0) / real.numpy().sum(1)
        masks = (step_mask, real)
    else:
        want_loss, want_acc, masks = losses.mean(0), hits.sum(-1).sum(0) / (K * B), None
    reads = _Reads(monkeypatch)
    reads.on = True
    mean_losses, accuracies, terms = BatchedExecutor._means(record, masks, S)
    reads.on = False
    assert reads.count == 1
    np.testing.assert_allclose(mean_losses, want_loss, rtol=1e-6)
    np.testing.assert_allclose(accuracies, want_acc, rtol=1e-6)
    assert terms == {}  # no named loss terms: no columns


def test_a_batched_fit_reads_the_clients_metrics_once_a_round(tmp_path, monkeypatch):
    reads = _Reads(monkeypatch)
    original, per_round = BatchedExecutor._means, []

    def counted(record, masks, size):
        before, reads.on = reads.count, True
        try:
            return original(record, masks, size)
        finally:
            reads.on = False
            per_round.append(reads.count - before)

    monkeypatch.setattr(BatchedExecutor, "_means", staticmethod(counted))
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=4), execution="batched")
    tiny_trainer(tmp_path, 3).fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=4))
    assert per_round == [1, 1, 1]
