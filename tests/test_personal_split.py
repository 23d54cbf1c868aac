"""Personalized selection never sees the reported numbers: each client's held-out data has a validation half
(``val/personal_*``: "best" is chosen on it) and a test half (``test/personal_*``: reported)."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.core.objective import Objective
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


def test_the_halves_are_disjoint_and_make_up_the_holdout():
    data = tiny_datamodule(num_clients=6, holdout_fraction=0.4)
    data.setup()
    for cid in range(6):
        val, test = data.client_holdout_part(cid, "validation"), data.client_holdout_part(cid, "test")
        held = data.client_holdout[cid]
        assert len(val) == len(held) // 2 and len(val) + len(test) == len(held) > 0
        assert torch.equal(torch.cat([val, test]).sort().values, held)


def _global_accuracy_mean(module, data, part):
    accs = []
    for cid in range(data.num_clients):
        indices = data.client_holdout_part(cid, part)
        if len(indices):
            _, logits, target = Objective(module.model)(data.client_holdout_batch(cid, part))
            accs.append(float((logits.argmax(-1) == target).double().mean()))
    return sum(accs) / len(accs)


def test_val_and_test_personal_metrics_are_measured_on_their_own_halves(tmp_path):
    data = tiny_datamodule(num_clients=6, holdout_fraction=0.4)
    module = tiny_module()
    trainer = tiny_trainer(tmp_path, 2, limit_val_batches=1.0, val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=data)
    val = float(trainer.callback_metrics["val/personal_acc_mean"])
    trainer.test(module, datamodule=data, verbose=False)
    test = float(trainer.callback_metrics["test/personal_acc_mean"])
    module.eval()
    with torch.no_grad():  # FedAvg: every client predicts with the global model
        assert abs(val - _global_accuracy_mean(module, data, "validation")) < 1e-6  # logged as float32
        assert abs(test - _global_accuracy_mean(module, data, "test")) < 1e-6
        assert val != test  # different samples


def test_the_test_writes_each_clients_global_and_personal_accuracy(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from fl_lightning.algorithms import FedSim
    from fl_lightning.engine.client_record import FILE

    data = tiny_datamodule(num_clients=6, holdout_fraction=0.4, new_client_fraction=0.34)
    torch.manual_seed(0)
    from fl_lightning import FederatedModule, LocalTraining
    from fl_lightning.models import MLP

    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), FedSim(), LocalTraining(lr=0.1, steps=3, batch_size=8),
                             personal=["net.3.*"])  # fmt: skip
    trainer = tiny_trainer(tmp_path, 3, logger=CSVLogger(tmp_path, name="run"))
    trainer.fit(module, datamodule=data)
    trainer.test(module, datamodule=data, verbose=False)
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "version_0" / FILE)) if r["split"] == "test"]
    unseen = set(data.unseen_clients)
    assert [int(r["client"]) for r in rows] == [c for c in range(6) if len(data.client_holdout_part(c, "test"))]
    assert {int(r["client"]) for r in rows if r["seen"] == "0"} == unseen and unseen
    seen = [r for r in rows if r["seen"] == "1"]
    mean = sum(float(r["personal_acc"]) for r in seen) / len(seen)
    assert abs(mean - float(trainer.callback_metrics["test/personal_acc_mean"])) < 1e-6
    assert any(r["global_acc"] != r["personal_acc"] for r in seen)  # the personal head differs from the global one


def test_scoring_a_client_that_trained_as_unseen_says_so(tmp_path, caplog):
    import logging

    from fl_lightning.algorithms import SCAFFOLD

    data = tiny_datamodule(num_clients=6, holdout_fraction=0.4)
    module = tiny_module(SCAFFOLD())  # keeps a state per client that trained
    tiny_trainer(tmp_path, 2).fit(module, datamodule=data)
    trained = next(iter(module.store.client_ids()))
    with caplog.at_level(logging.WARNING):
        module.unseen_prediction_params(trained)
        module.unseen_prediction_params(trained)
    said = [r.getMessage() for r in caplog.records if "trained in this run" in r.getMessage()]
    assert len(said) == 1 and f"client {trained} trained in this run" in said[0]


def test_the_spread_across_clients_matches_numpy():
    """_acc_var (ddof 0, q-FFL's fairness measure), _acc_best10 and _acc_worst10 against numpy on 12 clients."""
    import numpy as np

    from fl_lightning.engine.personal_eval import summary

    accs = np.array([0.9, 0.5, 1.0, 0.75, 0.2, 0.6, 0.95, 0.4, 0.8, 0.3, 0.65, 0.55])
    out = summary("personal", torch.tensor(accs), torch.zeros(12, dtype=torch.float64), torch.ones(12, dtype=torch.float64))
    ordered = np.sort(accs)  # 10% of 12 clients: the ceiling, 2
    assert out["personal_acc_var"] == pytest.approx(np.var(accs), abs=1e-15)
    assert out["personal_acc_worst10"] == pytest.approx(ordered[:2].mean(), abs=1e-15)
    assert out["personal_acc_best10"] == pytest.approx(ordered[-2:].mean(), abs=1e-15)
