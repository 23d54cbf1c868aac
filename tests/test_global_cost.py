"""Callbacks evaluate through the module's objective: dict batches (LoRA GPT-2), penalised
outputs (SplitLogistic) and plain logits alike."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from datamodules import IID
from fl_lightning import LocalTraining
from fl_lightning.algorithms import FedAvg, FedAvgP
from fl_lightning.engine.callbacks import GlobalCost, PerClientEvaluation
from tests.conftest import tiny_trainer
from tests.test_lora import assets, lora_module, one_thread, sst2  # noqa: F401  (fixtures)
from tests.test_personalization import binary_data, split_module

pytestmark = pytest.mark.filterwarnings("ignore")


def _reference_cost(model, data) -> float:
    """(1/N) sum_n f_n(x): the model's own outputs and penalty, in float64, client by client."""
    model = copy.deepcopy(model).double().eval()
    losses = []
    with torch.no_grad():
        for cid in range(data.num_clients):
            batch = data.client_full_batch(cid)
            if isinstance(batch, dict):
                out = model(**{k: v for k, v in batch.items() if k != "labels"})
                losses.append(F.cross_entropy(getattr(out, "logits", out), batch["labels"]))
            else:
                inputs, target = batch
                out = model(inputs.double())
                losses.append(F.cross_entropy(out.logits, target) + out.penalty)
    return float(torch.stack(losses).mean())


def test_global_cost_and_per_client_evaluation_on_split_logistic(tmp_path):
    module = split_module(FedAvgP(), LocalTraining(lr=0.1, steps=2, batch_size=8))
    data = binary_data(num_clients=4, clients_per_round=2, holdout_fraction=0.25)
    cost, per_client = GlobalCost(), PerClientEvaluation()
    trainer = tiny_trainer(tmp_path, rounds=2, limit_val_batches=None, val_check_interval=2, check_val_every_n_epoch=None,
                           callbacks=[cost, per_client])  # fmt: skip
    trainer.fit(module, datamodule=data)
    module.model.train()
    assert len(cost.history) == 3 and cost.history[0] > cost.history[-1]
    assert cost.history[-1] == pytest.approx(_reference_cost(module.model, data), rel=1e-12)
    assert 0 <= float(trainer.callback_metrics["clients/acc_mean"]) <= 1


def test_global_cost_and_per_client_evaluation_on_lora_gpt2(assets, tmp_path):  # noqa: F811
    module = lora_module(assets, FedAvg())
    data = sst2(assets, num_clients=2, per_round=2, holdout_fraction=0.25)
    cost = GlobalCost()
    trainer = tiny_trainer(tmp_path, rounds=1, limit_val_batches=None, val_check_interval=1, check_val_every_n_epoch=None,
                           callbacks=[cost, PerClientEvaluation()])  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert len(cost.history) == 2 and all(torch.isfinite(torch.tensor(cost.history)))
    module.model.eval()
    assert cost.history[-1] == pytest.approx(_reference_cost(module.model, data), rel=1e-6)
    assert 0 <= float(trainer.callback_metrics["clients/acc_mean"]) <= 1
