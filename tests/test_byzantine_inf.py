"""A Byzantine client sending Inf every round: a robust rule excludes its upload before the rule (counted in
``robust/nonfinite``) and the run finishes at the accuracy of the same run without that client; without a
rule the run stops, naming the client as a configured attacker."""

from __future__ import annotations

import pytest
import torch

from datamodules import IID, FederatedDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.adversary import Attack, GaussianUpload
from fl_lightning.reliability.faults import DivergenceError
from fl_lightning.robust import Robust
from fl_lightning.rounds import SHAPE, RoundStage
from models import MLP
from tests.conftest import tiny_trainer

ATTACKER, CLIENTS, ROUNDS = 3, 10, 8


class LeaveOut(RoundStage):
    """The reference run: ``client`` never trains (it leaves every round's cohort)."""

    name, order = "leave_out", SHAPE

    def __init__(self, client: int) -> None:
        self.client = client

    def shape_cohort(self, round, cohort) -> None:
        cohort.keep([i for i, c in enumerate(cohort.client_ids) if c != self.client])


class Rows:
    def __init__(self):
        import lightning as L

        class Grab(L.Callback):
            def on_train_batch_end(cb, trainer, *args):
                self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})

        self.rows, self.callback = [], Grab()


def _accuracy(tmp_path, rule, **kw):
    torch.manual_seed(0)
    data = FederatedDataModule(dataset="digits", num_clients=CLIENTS, partition=IID(), participation=UniformSampling(CLIENTS),
                               val_fraction=0.1)  # fmt: skip
    module = FederatedModule(MLP(in_features=64, num_classes=10, hidden=[32]), local=LocalTraining(lr=0.1, steps=10, batch_size=20),
                             robust=Robust(rule, f=1) if rule else None, **kw)  # fmt: skip
    rows = Rows()
    trainer = tiny_trainer(tmp_path, ROUNDS, callbacks=[rows.callback])
    trainer.fit(module, datamodule=data)
    return trainer.test(module, datamodule=data, verbose=False)[0]["test/acc"], rows.rows


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "multi_krum"])
def test_a_defended_run_survives_an_attacker_sending_inf_every_round(tmp_path, rule):
    attacked, rows = _accuracy(tmp_path / "a", rule, attack=Attack(clients=[ATTACKER], upload=GaussianUpload(std=1e300)))
    without, _ = _accuracy(tmp_path / "b", rule, stages=[LeaveOut(ATTACKER)])
    assert [r["robust/nonfinite"] for r in rows] == [1.0] * ROUNDS
    assert without > 0.5 and abs(attacked - without) <= 0.01, (rule, attacked, without)
    print(f"{rule}: accuracy {attacked:.4f} with the Inf attacker, {without:.4f} without that client")


def test_without_a_rule_the_run_stops_naming_the_attacker(tmp_path):
    with pytest.raises(DivergenceError, match=f"client {ATTACKER} sent a non-finite update .*configured attacker .*model.robust") as error:
        _accuracy(tmp_path, None, attack=Attack(clients=[ATTACKER], upload=GaussianUpload(std=1e300)))
    assert "lower local.lr" not in str(error.value)
