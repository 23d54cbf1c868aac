"""Results do not depend on how clients are executed (docs/algorithms.md, E13)."""

import logging

import pytest
import torch
from torch import nn

from datamodules import FederatedDataModule, IID
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import SCAFFOLD, FAdamET, FAdamGT, FedCM, FedDyn, FedLADA, FedMIM, FedProx, FedSAM, LocalAdam
from fl_lightning.executors import BatchedExecutionError, BatchedExecutor
from models import MLP, SmallCNN
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.test_resume import StatefulFedAvg


def _fit(tmp_path, model_fn, algorithm_fn, execution, data_fn=tiny_datamodule, rounds=3, local=None):
    torch.manual_seed(0)
    module = FederatedModule(
        model_fn(), algorithm_fn(), local or LocalTraining(lr=0.1, steps=3, batch_size=8), execution=execution
    )
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=data_fn())
    return module


def _digits():
    return FederatedDataModule("digits", num_clients=10, partition=IID(), participation=UniformSampling(4))


# docs/algorithms.md, E13
@pytest.mark.parametrize(
    "model_fn, data_fn",
    [(lambda: MLP(8, 3, hidden=[16]), tiny_datamodule), (lambda: SmallCNN(channels=4, hidden=16), _digits)],
    ids=["mlp", "cnn"],
)
@pytest.mark.parametrize(
    "algorithm_fn", [FedAvg, StatefulFedAvg, SCAFFOLD, FedMIM, FedSAM], ids=["fedavg", "stateful", "scaffold", "fedmim", "fedsam"]
)
def test_batched_equals_sequential(tmp_path, model_fn, data_fn, algorithm_fn):
    seq = _fit(tmp_path, model_fn, algorithm_fn, "sequential", data_fn)
    bat = _fit(tmp_path, model_fn, algorithm_fn, "batched", data_fn)
    assert not bat.executor.inner.fallbacks  # every round ran stacked
    _assert_same_training(seq, bat)


def _assert_same_training(seq, bat, state_atol=1e-6):
    """Same global model and client store, to float tolerance."""
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = seq.store.state_dict(), bat.store.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=state_atol)


class BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


class SmoothedMLP(MLP):
    """A model with its own loss: batched execution evaluates it under vmap."""

    def loss(self, logits, target):
        return torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.2)


@pytest.mark.parametrize(
    "model_fn, local, reason",
    [
        (BatchNormMLP, None, "BatchNorm running statistics"),
        (lambda: SmoothedMLP(8, 3), LocalTraining(lr=0.1, steps=2, batch_size=1000), "the model's own loss reduces over the batch's rows"),
    ],
)
def test_batched_falls_back_to_sequential_with_a_reason(tmp_path, caplog, model_fn, local, reason):
    with caplog.at_level(logging.WARNING, logger="fl_lightning.executors.batched"):
        bat = _fit(tmp_path, model_fn, FedAvg, "batched", local=local)
    assert reason in caplog.text
    assert bat.executor.inner.stats["stacked_rounds"] == 0 and bat.executor.inner.stats["rounds"] == 3
    seq = _fit(tmp_path, model_fn, FedAvg, "sequential", local=local)
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        assert torch.equal(a, b)


def test_full_batch_rounds_run_stacked(tmp_path):
    """local.batch_size null (full batch: clients of unequal size) runs stacked, rows padded and masked, with the
    results of sequential execution; the module's executor (the DistributedExecutor wrapper) shows its inner one's stats."""
    local = LocalTraining(lr=0.1, steps=2, batch_size=None)
    bat = _fit(tmp_path, lambda: MLP(8, 3), FedAvg, "batched", local=local)
    assert not bat.executor.fallbacks and bat.executor.stats is bat.executor.inner.stats
    assert bat.executor.stats["stacked_rounds"] == 3 and bat.executor.stats["padded_work"] > 0
    _assert_same_training(_fit(tmp_path, lambda: MLP(8, 3), FedAvg, "sequential", local=local), bat)


def test_executor_fallbacks_reach_through_the_message_pipeline(tmp_path):
    """With message stages the batched executor sits under a MessageExecutor: executor.fallbacks still finds its counter."""
    from fl_lightning.compression import Compression, TopK

    torch.manual_seed(0)
    module = FederatedModule(
        BatchNormMLP(), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), execution="batched", compression=Compression(up=TopK(ratio=0.5))
    )  # fmt: skip
    tiny_trainer(tmp_path, 2).fit(module, datamodule=tiny_datamodule())
    assert type(module.executor.inner).__name__ == "MessageExecutor"
    assert module.executor.fallbacks is module.executor.inner.inner.fallbacks
    assert sum(module.executor.fallbacks.values()) == 2 and "BatchNorm running statistics" in next(iter(module.executor.fallbacks))


def test_unknown_execution_is_rejected():
    with pytest.raises(ValueError, match="execution must be one of \\['auto', 'batched', 'sequential'\\]"):
        FederatedModule(MLP(8, 3), execution="parallel")


class NoisyDataModule(FederatedDataModule):
    """Per-client, per-round random input noise drawn from the augment generator."""

    def augment(self, batch, client_id, generator):
        x, y = batch
        return x + 0.1 * torch.randn(x.shape, generator=generator) + client_id, y


def test_batched_applies_per_client_augmentation_like_sequential(tmp_path):
    def data():
        return NoisyDataModule(
            "synthetic", dict(num_samples=300, num_features=8, num_classes=3, seed=1), num_clients=6,
            partition=IID(), participation=UniformSampling(3),
        )  # fmt: skip

    mlp = lambda: MLP(8, 3, hidden=[16])  # noqa: E731
    seq = _fit(tmp_path, mlp, FedAvg, "sequential", data)
    bat = _fit(tmp_path, mlp, FedAvg, "batched", data)
    plain = _fit(tmp_path, mlp, FedAvg, "sequential")
    for a, b, c in zip(seq.model.parameters(), bat.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a, c)


@pytest.mark.parametrize("algorithm_fn", [lambda: FAdamET(tracking=0.5), lambda: FAdamGT(tracking=0.5)], ids=["et", "gt"])
def test_rules_branching_on_the_client_id_run_batched(tmp_path, algorithm_fn):
    """FAdam picks its tracking subset by client id in ``client_finish``: the steps run stacked,
    the finish client by client, and the result equals sequential execution."""
    mlp = lambda: MLP(8, 3, hidden=[16])  # noqa: E731
    seq = _fit(tmp_path, mlp, algorithm_fn, "sequential")
    bat = _fit(tmp_path, mlp, algorithm_fn, "batched")
    assert not bat.executor.inner.fallbacks
    assert type(bat.algorithm) in bat.executor.inner._finish_per_client
    _assert_same_training(seq, bat, state_atol=1e-5)


@pytest.mark.parametrize(
    "algorithm_fn",
    [lambda: FedProx(mu=0.1), lambda: FedDyn(alpha=0.1), lambda: FedCM(a=0.5), LocalAdam, lambda: FedLADA(a=0.5)],
    ids=["fedprox", "feddyn", "fedcm", "localadam", "fedlada"],
)
def test_elementwise_rules_give_sequential_results_when_stacked(tmp_path, algorithm_fn):
    """Every rule declaring ``elementwise = True`` is applied once to all stacked clients."""
    assert algorithm_fn().elementwise
    mlp = lambda: MLP(8, 3, hidden=[16])  # noqa: E731
    seq = _fit(tmp_path, mlp, algorithm_fn, "sequential")
    bat = _fit(tmp_path, mlp, algorithm_fn, "batched")
    _assert_same_training(seq, bat, state_atol=1e-5)


def test_rules_with_reductions_run_under_vmap(tmp_path, monkeypatch):
    """FedSAM normalises its gradient per client: it must not see the stacked tensors."""
    calls = {"vmapped": 0, "elementwise": 0}
    for name in calls:
        original = getattr(BatchedExecutor, f"_{name}_rule")

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BatchedExecutor, f"_{name}_rule", spy)
    _fit(tmp_path, lambda: MLP(8, 3, hidden=[16]), FedSAM, "batched")
    assert calls == {"vmapped": 3, "elementwise": 0}
    _fit(tmp_path, lambda: MLP(8, 3, hidden=[16]), FedAvg, "batched")
    assert calls == {"vmapped": 3, "elementwise": 3}


@pytest.mark.parametrize(
    "algorithm_fn", [FedAvg, SCAFFOLD, FedSAM, lambda: FAdamGT(tracking=0.5)], ids=["fedavg", "scaffold", "fedsam", "fadam_gt"]
)
def test_stacking_in_groups_gives_the_results_of_one_stack(tmp_path, stacked_sizes, algorithm_fn):
    """``max_stacked_clients=2`` runs a round of 5 clients as stacks of 2, 2 and 1, every one of them
    stacked (no fallback), with the results of sequential execution and of one stack of 5."""
    sizes = stacked_sizes
    mlp, data = lambda: MLP(8, 3, hidden=[16]), lambda: tiny_datamodule(num_clients=8, clients_per_round=5)  # noqa: E731
    seq = _fit(tmp_path, mlp, algorithm_fn, "sequential", data)
    whole = _fit(tmp_path, mlp, algorithm_fn, "batched", data)
    assert sizes == [5, 5, 5]
    grouped = _fit(tmp_path, mlp, algorithm_fn, BatchedExecutor(max_stacked_clients=2), data)
    assert sizes[3:] == [2, 2, 1] * 3 and not grouped.executor.inner.fallbacks
    _assert_same_training(seq, grouped, state_atol=1e-5)
    _assert_same_training(whole, grouped, state_atol=1e-5)


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_max_stacked_clients_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="execution.max_stacked_clients must be an integer >= 1 or null"):
        BatchedExecutor(max_stacked_clients=value)


def test_batched_uses_the_models_own_loss(tmp_path):
    model = lambda: SmoothedMLP(8, 3, hidden=[16])  # noqa: E731
    seq = _fit(tmp_path, model, FedAvg, "sequential")
    bat = _fit(tmp_path, model, FedAvg, "batched")
    plain = _fit(tmp_path, lambda: MLP(8, 3, hidden=[16]), FedAvg, "batched")
    for a, b, c in zip(seq.model.parameters(), bat.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(a, c)


def test_index_matrix_matches_the_sequential_batches():
    data = tiny_datamodule(num_clients=5)
    data.setup()
    for client in range(5):
        for batch_size, steps in [(2, 9), (4, 3), (3, 20), (8, 7)]:
            rows = list(data.client_batch_indices(client, 7 + client, batch_size, steps))
            matrix = data.client_batch_index_matrix(client, 7 + client, batch_size, steps)
            assert torch.equal(torch.stack(rows), matrix)
    with pytest.raises(ValueError, match="fewer than batch_size=1000"):
        data.client_batch_index_matrix(0, 0, 1000, 2)


@pytest.mark.parametrize("chunk", [1, 4, 7, 1024])
def test_index_chunks_are_the_index_matrix_in_bounded_pieces(monkeypatch, chunk):
    """Long rounds build their batch indices GATHER_STEPS steps at a time (memory independent of the steps),
    with exactly the rows of the whole matrix, in sequential and stacked execution."""
    import datamodules.federated as federated

    data = tiny_datamodule(num_clients=5)
    data.setup()
    monkeypatch.setattr(federated, "GATHER_STEPS", chunk)
    for client in range(5):
        for batch_size, steps in [(2, 9), (4, 3), (3, 20), (8, 7)]:
            matrix = data.client_batch_index_matrix(client, 7 + client, batch_size, steps)
            chunks = list(data.client_batch_index_chunks(client, 7 + client, batch_size, steps))
            assert all(len(c) <= chunk for c in chunks) and torch.equal(torch.cat(chunks), matrix)
            sequential = list(data.client_batches(client, 7 + client, batch_size, steps))
            assert all(torch.equal(a, b) for x, y in zip(sequential, zip(*(t[matrix].unbind(0) for t in data.source.train.tensors))) for a, b in zip(x, y))
    clients, seeds, batch_size, steps = [0, 2, 3], [5, 6, 7], 3, 11
    stacked = list(data.stacked_client_batches(clients, seeds, batch_size, steps))
    index = torch.stack([data.client_batch_index_matrix(c, s, batch_size, steps) for c, s in zip(clients, seeds)])
    assert len(stacked) == steps
    for k, batch in enumerate(stacked):
        assert all(torch.equal(part, t[index[:, k]]) for part, t in zip(batch, data.source.train.tensors))
