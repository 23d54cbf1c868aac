"""``train/acc``: the clients' training accuracy during their local steps, the same whatever executes them."""

from __future__ import annotations

import copy

import pytest
import torch

from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.algorithms import FedSAM
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer


def _module(algorithm, execution="sequential", **local):
    torch.manual_seed(0)
    settings = dict(lr=0.1, steps=1, batch_size=None)
    settings.update(local)
    return FederatedModule(MLP(8, 3, hidden=[16]), algorithm, LocalTraining(**settings), execution=execution)


def test_one_full_batch_step_reports_the_broadcast_models_accuracy_on_each_clients_data(tmp_path):
    """K = 1 on the whole local set: each client's training accuracy is x's accuracy on its data."""
    module = _module(FedAvg())
    x0 = copy.deepcopy(module.model)
    data = tiny_datamodule(num_clients=4, clients_per_round=4)
    trainer = tiny_trainer(tmp_path, rounds=1)
    trainer.fit(module, datamodule=data)
    expected = []
    for cid in range(4):
        inputs, target = data.client_full_batch(cid)
        expected.append(float((x0(inputs).argmax(-1) == target).double().mean()))
    assert float(trainer.callback_metrics["train/acc"]) == pytest.approx(sum(expected) / 4, abs=1e-6)


@pytest.mark.parametrize("algorithm", [FedAvg, FedSAM], ids=["stacked", "vmapped"])
def test_batched_execution_reports_the_same_training_accuracy(tmp_path, algorithm):
    accuracy = {}
    for execution in ("sequential", "batched"):
        module = _module(algorithm(), execution, steps=3, batch_size=8)
        trainer = tiny_trainer(tmp_path, rounds=3)
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
        accuracy[execution] = float(trainer.callback_metrics["train/acc"])
        if execution == "batched":
            assert not module.executor.inner.fallbacks
    assert 0 < accuracy["sequential"] <= 1 and accuracy["batched"] == pytest.approx(accuracy["sequential"], abs=1e-6)
