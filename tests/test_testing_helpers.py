"""fl_lightning.experiments.testing: check_batched catches a wrongly declared ``elementwise``; one_round works by hand;
BatchedExecutor(verify_first_round=True) stops a run whose user-declared elementwise rule is not."""

import pytest
import torch

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.algorithms import SCAFFOLD, FedALA
from fl_lightning.executors import BatchedExecutionError, BatchedExecutor
from fl_lightning.experiments.testing import BatchedMismatch, check_batched, one_round
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


class ClippedFedAvg(FedAvg):
    """Clips each local gradient to global norm <= max_norm: a reduction over all tensors (honest: no declaration)."""

    max_norm = 0.05

    def client_step(self, params, local, ctx):
        _, grad = ctx.grad(params)
        norm = torch.sqrt(sum((g * g).sum() for g in grad.values()))
        scale = torch.clamp(self.max_norm / (norm + 1e-12), max=1.0)
        return {k: p - ctx.lr * scale * grad[k] for k, p in params.items()}, local


class WronglyElementwise(ClippedFedAvg):
    elementwise = True  # wrong: stacked, the norm is taken over all clients at once


def test_check_batched_catches_a_wrongly_declared_elementwise():
    message = r"WronglyElementwise: batched execution differs from sequential by .* declares elementwise = True"
    with pytest.raises(BatchedMismatch, match=message):
        check_batched(WronglyElementwise())


def test_check_batched_passes_the_honest_declaration_and_builtins():
    honest = check_batched(ClippedFedAvg())
    assert honest.stacked_rule == "vmap" and honest.max_difference < 1e-6
    for algorithm in (FedAvg(), SCAFFOLD()):  # SCAFFOLD: client and server state compared too
        result = check_batched(algorithm)
        assert result.stacked_rule == "elementwise" and result.max_difference < 1e-6


class SequentialOnly(FedAvg):
    batchable = False  # a declared reason to run every round client by client


def test_check_batched_refuses_a_vacuous_comparison():
    with pytest.raises(ValueError, match="fell back to sequential .*declares batchable = False"):
        check_batched(SequentialOnly(), local=LocalTraining(lr=0.1, steps=3, batch_size=8))


def test_check_batched_compares_full_gradients_stacked():
    """FedALA's weight learning reads full local gradients: stacked over the clients' padded whole sets."""
    result = check_batched(FedALA(), local=LocalTraining(lr=0.1, steps=3, batch_size=8))
    assert result.stacked_rule == "vmap" and result.max_difference < 1e-5


def test_one_round_on_a_hand_worked_fedavg_round():
    """x = 1, client 0: g = 1, 1 (two steps), client 1: g = 3 (one step), lr 0.5, w = (1/4, 3/4):
    Delta = (-1, -1.5), d = 0.25 + 1.125 = 1.375, x_new = 1 - 1.375."""
    x = {"w": torch.tensor([1.0])}
    one, three = {"w": torch.tensor([1.0])}, {"w": torch.tensor([3.0])}
    r = one_round(FedAvg(), x, [[one, one], [three]], lr=0.5, weights=[0.25, 0.75])
    assert [u["delta"]["w"].item() for u in r.uploads] == [-1.0, -1.5]
    assert r.pseudo_grad["w"].item() == 1.375 and r.x["w"].item() == 1.0 - 1.375
    quadratic = one_round(FedAvg(), x, [(lambda p: {"w": 2 * p["w"]}, 2)], lr=0.25)  # f = w^2: w <- w / 2 per step
    assert quadratic.x["w"].item() == 0.25


def _fit_batched(tmp_path, algorithm):
    module = tiny_module(algorithm, LocalTraining(lr=0.5, steps=3, batch_size=8))
    module.executor.inner = BatchedExecutor(verify_first_round=True)
    tiny_trainer(tmp_path, 2).fit(module, datamodule=tiny_datamodule())
    return module


def test_batched_executor_verifies_a_user_declared_elementwise_rule(tmp_path):
    message = r"round 0: WronglyElementwise declares elementwise = True, but its batched upload delta/"
    with pytest.raises(BatchedExecutionError, match=message):
        _fit_batched(tmp_path, WronglyElementwise())
    _fit_batched(tmp_path, ClippedFedAvg())  # honest: runs per client under vmap, nothing to verify


def test_verification_runs_once_and_only_for_user_declarations(tmp_path, monkeypatch):
    class Declared(FedAvg):
        elementwise = True  # honest

    calls = []
    original = BatchedExecutor.run

    def recording(self, tasks, info, runtime):
        calls.append(set(self._verified))
        return original(self, tasks, info, runtime)

    monkeypatch.setattr(BatchedExecutor, "run", recording)
    module = _fit_batched(tmp_path, Declared())
    assert module.executor.inner._verified == {Declared}
    assert calls[0] == set() and calls[1] == {Declared}  # verified in round 0, not again
    assert not _fit_batched(tmp_path, FedAvg()).executor.inner._verified  # a built-in declaration is trusted
