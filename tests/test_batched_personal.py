"""Personal tensors run stacked under batched execution (eager and compiled) and equal sequential execution."""

import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import FedAlt, FedAvgP, FedSim, ScaffoldP
from fl_lightning.executors import BatchedExecutor, SequentialExecutor
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

LOCAL = LocalTraining(lr=0.2, steps=3, batch_size=8, personal_lr=0.1)


def _run(tmp_path, algorithm, executor, rounds=3):
    torch.manual_seed(0)
    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), algorithm, LOCAL, personal=["net.3.*"], execution=executor)
    tiny_trainer(tmp_path, rounds=rounds).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
    return module


@pytest.mark.parametrize("make", [FedSim, lambda: FedAvgP(eta_u=0.8, eta_v=0.5), lambda: FedAlt(personal_steps=1), ScaffoldP])
def test_personal_tensors_stack_and_equal_sequential_execution(tmp_path, make):
    seq = _run(tmp_path / "s", make(), SequentialExecutor())
    bat = _run(tmp_path / "b", make(), BatchedExecutor())
    assert not bat.executor.inner.fallbacks  # stacked, not a declared fallback
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert seq.store.client_ids() == bat.store.client_ids()
    for cid in seq.store.client_ids():
        for k, v in seq.client_personal(cid).items():
            torch.testing.assert_close(bat.client_personal(cid)[k], v, rtol=1e-5, atol=1e-6)


def test_personal_tensors_stack_under_compiled_batched_execution(tmp_path):
    seq = _run(tmp_path / "s", FedAvgP(eta_u=1.0, eta_v=0.5), SequentialExecutor(), rounds=2)
    bat = _run(tmp_path / "b", FedAvgP(eta_u=1.0, eta_v=0.5), BatchedExecutor(compile=True, backend="aot_eager"), rounds=2)
    assert not bat.executor.inner.fallbacks and not bat.executor.inner.compile_fallbacks
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for cid in seq.store.client_ids():
        for k, v in seq.client_personal(cid).items():
            torch.testing.assert_close(bat.client_personal(cid)[k], v, rtol=1e-5, atol=1e-6)
