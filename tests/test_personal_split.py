"""Personalized selection never sees the reported numbers: each client's held-out data has a validation half
(``val/personal_*``: "best" is chosen on it) and a test half (``test/personal_*``: reported)."""

from __future__ import annotations

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
