"""Bytes sent per round, per algorithm: pinned to the table of docs/algorithms.md, section 17."""

from __future__ import annotations

import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning import algorithms as A
from fl_lightning.core.params import num_bytes
from models import MLP
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

N, S = 6, 4
# algorithm -> (model-sized messages down per client, up per client); FAdam: 1 more up for each client of Y_t
TABLE = {
    "FedAvg": (A.FedAvg, 1, 1),
    "FedProx": (lambda: A.FedProx(mu=0.1), 1, 1),
    "FedSAM": (A.FedSAM, 1, 1),
    "FedDyn": (lambda: A.FedDyn(alpha=0.1), 1, 1),
    "FedAdam": (A.FedAdam, 1, 1),
    "FedYogi": (A.FedYogi, 1, 1),
    "FedAvgM": (A.FedAvgM, 1, 1),
    "FedAvgSVRG": (lambda: A.FedAvgSVRG(snapshots=1, inner_steps=3), 1, 1),
    "LocalAdam": (A.LocalAdam, 1, 1),
    "SCAFFOLD": (A.SCAFFOLD, 2, 2),
    "FedCM": (A.FedCM, 2, 1),
    "FedMIM": (A.FedMIM, 3, 1),
    "FedMIM-client-history": (lambda: A.FedMIM(history="client"), 1, 1),
    "FedLADA": (A.FedLADA, 2, 1),
    "FAdamET": (lambda: A.FAdamET(tracking=0.5), 2, 1),
    "FAdamGT": (lambda: A.FAdamGT(tracking=0.5), 2, 1),
    "FedAvgP": (A.FedAvgP, 1, 1),
    "FedSim": (A.FedSim, 1, 1),
    "FedAlt": (A.FedAlt, 1, 1),
    "ScaffoldP": (lambda: A.ScaffoldP(warm_start=False), 2, 2),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_bytes_per_round_match_the_table(tmp_path, name):
    make, down, up = TABLE[name]
    module = tiny_module(make(), LocalTraining(lr=0.05, steps=3, batch_size=8))
    model_bytes = num_bytes(module.global_params().values())
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S))
    tracked = round(0.5 * S) if name.startswith("FAdam") else 0  # |Y_t| = S/2
    assert module.comm_totals == {"bytes_down": down * S * model_bytes, "bytes_up": (up * S + tracked) * model_bytes, "client_uploads": S}


def test_scaffold_p_warm_start_costs_three_messages_per_client_once(tmp_path):
    module = tiny_module(A.ScaffoldP(warm_start=True), LocalTraining(lr=0.05, steps=3, batch_size=8))
    model_bytes = num_bytes(module.global_params().values())
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S))
    # warm-up: (u, c) down and c_i^0 up for every one of the N clients; then the round: 4 per active client
    assert module.comm_totals["bytes_down"] + module.comm_totals["bytes_up"] == (3 * N + 4 * S) * model_bytes


# ---- FedMIM with the history kept by the clients (the paper's convention) ---------------------------------
def _fedmim(tmp_path, history, clients_per_round, execution="sequential", rounds=4):
    torch.manual_seed(0)
    local = LocalTraining(lr=0.05, steps=3, batch_size=8)
    module = FederatedModule(MLP(8, 3, hidden=[16]), A.FedMIM(history=history), local, execution=execution)
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=clients_per_round))
    return module


def test_fedmim_client_history_equals_server_history_under_full_participation(tmp_path):
    server, client = _fedmim(tmp_path, "server", N), _fedmim(tmp_path, "client", N)
    for a, b in zip(server.model.parameters(), client.model.parameters()):
        assert torch.equal(a, b)


def test_fedmim_client_history_differs_when_clients_skip_rounds_and_batches(tmp_path):
    server, client = _fedmim(tmp_path, "server", 2), _fedmim(tmp_path, "client", 2)
    assert not all(torch.equal(a, b) for a, b in zip(server.model.parameters(), client.model.parameters()))
    batched = _fedmim(tmp_path, "client", 2, execution="batched")
    assert not batched.executor.inner.fallbacks
    for a, b in zip(client.model.parameters(), batched.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = client.store.state_dict(), batched.store.state_dict()
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-6)


def test_scaffold_logs_its_control_variate_norm_through_the_metrics_hook(tmp_path):
    module = tiny_module(A.SCAFFOLD(), LocalTraining(lr=0.05, steps=3, batch_size=8))
    trainer = tiny_trainer(tmp_path, rounds=2)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S))
    expected = float(sum((c.double() ** 2).sum() for c in module.server_state["c"].values())) ** 0.5
    assert float(trainer.callback_metrics["algo/c_norm"]) == pytest.approx(expected, rel=1e-6) and expected > 0
    assert float(trainer.callback_metrics["round"]) == 1.0 and float(trainer.callback_metrics["time/round_s"]) > 0
