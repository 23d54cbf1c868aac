"""Client faults (dropout, stragglers, raising clients) and divergence."""

import logging

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FedAvg, FederatedModule, LocalTraining
from fl_lightning.core.errors import FLError
from fl_lightning.reliability.faults import ClientError, ClientFailure, ClientFaults, DivergenceError, FatalClientError
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.test_resume import StatefulFedAvg

BROKEN = 2


class BrokenClient(StatefulFedAvg):
    """Client BROKEN always fails during local training (a declared, simulated fault)."""

    def client_step(self, params, local, ctx):
        if ctx.client_id == BROKEN:
            raise ClientFailure("sensor offline")
        return super().client_step(params, local, ctx)


class DivergesAtRound2(FedAvg):
    def client_finish(self, params, local, ctx):
        upload, state = super().client_finish(params, local, ctx)
        if ctx.info.round == 2:
            upload["delta"] = {k: v * float("nan") for k, v in upload["delta"].items()}
        return upload, state


def _module(algorithm, faults=ClientFaults(), local=None, execution="sequential"):
    torch.manual_seed(0)
    return FederatedModule(
        MLP(8, 3, hidden=[16]), algorithm, local or LocalTraining(lr=0.1, steps=4, batch_size=8), faults=faults,
        execution=execution,
    )  # fmt: skip


def test_dropout_and_a_raising_client_do_not_stop_training(tmp_path, caplog):
    module = _module(BrokenClient(), ClientFaults(dropout=0.3))
    with caplog.at_level(logging.WARNING):
        trainer = tiny_trainer(tmp_path, rounds=5)
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=6))
    assert trainer.global_step == 5
    assert f"client {BROKEN} failed and is left out of the aggregate: ClientFailure('sensor offline')" in caplog.text
    assert "dropped out (never reported)" in caplog.text
    assert "round 0:" in caplog.text
    assert BROKEN not in module.store, "a failing client's state must stay untouched"
    assert len(module.store) == 5


def test_fail_fast_stops_with_the_clients_error(tmp_path):
    module = _module(BrokenClient(), ClientFaults(fail_fast=True))
    with pytest.raises(ClientError, match=f"round 0: client {BROKEN} failed: ClientFailure\\('sensor offline'\\)"):
        tiny_trainer(tmp_path, rounds=3).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=6))


def test_survivor_weights_are_renormalised():
    from fl_lightning.reliability.faults import survivor_weights
    from fl_lightning.core.participation import RoundPlan

    plan = RoundPlan(0, torch.tensor([1, 4, 7]), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.zeros(3))
    weights = survivor_weights(plan.clients, plan.weights, [1, 7])
    torch.testing.assert_close(weights, torch.tensor([0.5, 0.2], dtype=torch.float64) / 0.7)


def test_stragglers_complete_part_of_their_steps():
    faults = ClientFaults(straggler=1.0, straggler_min_fraction=0.5)
    draws = [faults.draw(seed, 10) for seed in range(200)]
    assert all(not dropped and 5 <= steps < 10 for dropped, steps in draws)
    assert len({steps for _, steps in draws}) > 1
    assert faults.draw(7, 10) == faults.draw(7, 10), "faults are reproducible from the client seed"
    never = ClientFaults(dropout=0.0)
    assert never.draw(3, 10) == (False, 10)


def test_straggler_run_is_reproducible_and_batched_stacks_it(tmp_path):
    """Stragglers' rounds run stacked (their missing steps masked) with sequential execution's results."""
    faults = ClientFaults(straggler=0.5, straggler_min_fraction=0.25)
    results = []
    for execution in ("sequential", "batched"):
        module = _module(FedAvg(), faults, execution=execution)
        tiny_trainer(tmp_path, rounds=3).fit(module, datamodule=tiny_datamodule())
        results.append([p.detach() for p in module.model.parameters()])
    assert not module.executor.fallbacks and module.executor.stats["stacked_rounds"] == 3
    stats = module.executor.stats  # a straggler's missing steps: the stack shrank (no padding) below 3 rounds x 3 clients x 4 steps x 8 rows
    assert stats["padded_work"] == 0 and stats["real_work"] < 3 * 3 * 4 * 8
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_divergence_stops_naming_round_and_client_and_keeps_the_last_good_checkpoint(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds=5, enable_checkpointing=True, callbacks=[checkpoint])
    with pytest.raises(DivergenceError, match="round 2: client \\d+ sent a non-finite update \\(delta/"):
        trainer.fit(_module(DivergesAtRound2()), datamodule=tiny_datamodule())
    good = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert good["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in good["state_dict"].values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dropout=1.0), "faults.dropout must be in \\[0, 1\\)"),
        (dict(straggler=-0.1), "faults.straggler must be in \\[0, 1\\]"),
        (dict(straggler_min_fraction=0.0), "faults.straggler_min_fraction must be in \\(0, 1\\]"),
        (dict(max_failed_fraction=1.5), "faults.max_failed_fraction must be in \\[0, 1\\], got 1.5"),
        (dict(max_failed_fraction=-0.1), "faults.max_failed_fraction must be in \\[0, 1\\]"),
    ],
)
def test_bad_fault_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClientFaults(**kwargs)


# ---- faults that are faults (issue 20, defect 3) ----------------------------------------------------
class Raises(StatefulFedAvg):
    """Every client in ``failing`` raises ``error`` in its first local step."""

    def __init__(self, error, failing=None):
        super().__init__()
        self.error, self.failing = error, failing

    def client_step(self, params, local, ctx):
        if self.failing is None or ctx.client_id in self.failing:
            raise self.error
        return super().client_step(params, local, ctx)


def _fit(tmp_path, module, rounds=3, num_clients=6, clients_per_round=6):
    tiny_trainer(tmp_path, rounds=rounds).fit(module, datamodule=tiny_datamodule(num_clients, clients_per_round))
    return module


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_a_model_that_does_not_fit_the_data_stops_the_run_at_once(tmp_path, execution):
    """in_features 5 on 8 features: every client would fail; today the run trains nothing and succeeds."""
    torch.manual_seed(0)
    module = FederatedModule(MLP(5, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), execution=execution)
    with pytest.raises(FatalClientError, match="^round 0: client \\d+ raised RuntimeError: mat1 and mat2 shapes cannot be multiplied.*not a client fault") as info:
        _fit(tmp_path, module)
    assert "\n" not in str(info.value) and isinstance(info.value, FLError)
    assert module.global_step == 0


def test_too_few_classes_for_the_labels_stops_the_run(tmp_path):
    """num_classes 2 on 3 labels: the loss's index error recurs on every client."""
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 2, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8))
    with pytest.raises(FatalClientError, match="round 0: client \\d+ raised IndexError: Target \\d+ is out of bounds"):
        _fit(tmp_path, module)


@pytest.mark.parametrize(
    "error, hint",
    [
        (MemoryError(), "out of memory"),
        (OSError(28, "No space left on device"), "storage"),
        (TypeError("expected Float but found Double"), "model against the data"),
    ],
)
def test_memory_storage_and_type_errors_are_not_client_faults(tmp_path, error, hint):
    with pytest.raises(FatalClientError, match=f"round 0: client \\d+ raised {type(error).__name__}.*{hint}"):
        _fit(tmp_path, _module(Raises(error, failing={BROKEN})))


@pytest.mark.parametrize("error", [ClientFailure("crashed"), TimeoutError("no answer"), ConnectionError("reset")])
def test_declared_and_transient_failures_leave_the_client_out(tmp_path, error):
    module = _fit(tmp_path, _module(Raises(error, failing={BROKEN})))
    assert module.global_step == 3 and BROKEN not in module.store and len(module.store) == 5


def test_a_round_where_too_many_clients_fail_stops_the_run(tmp_path):
    module = _module(Raises(ClientFailure("down"), failing={0, 1, 2, 3}), ClientFaults(max_failed_fraction=0.5))
    with pytest.raises(ClientError, match="round 0: 4 of 6 clients failed, more than faults.max_failed_fraction = 0.5"):
        _fit(tmp_path, module)
    fine = _fit(tmp_path, _module(Raises(ClientFailure("down"), failing={0, 1, 2}), ClientFaults(max_failed_fraction=0.5)))
    assert fine.global_step == 3


def test_a_run_that_trained_no_client_does_not_succeed(tmp_path):
    module = _module(Raises(ClientFailure("down")), ClientFaults(max_failed_fraction=1.0))
    with pytest.raises(ClientError, match="no client completed its local training in 3 rounds"):
        _fit(tmp_path, module)


class FailsStacked(StatefulFedAvg):
    """Raises ClientFailure whenever client BROKEN trains, stacked with others or alone."""

    elementwise = True

    def client_step(self, params, local, ctx):
        if BROKEN in torch.as_tensor(ctx.client).reshape(-1).tolist():
            raise ClientFailure("down")
        return super().client_step(params, local, ctx)


def test_a_failing_batched_round_leaves_out_only_the_clients_that_fail_sequentially(tmp_path):
    module = _module(FailsStacked(), execution="batched")
    _fit(tmp_path, module)
    assert not module.executor.inner.fallbacks, "the stacked path ran (and raised)"
    assert module.global_step == 3 and BROKEN not in module.store and len(module.store) == 5


# ---- divergence (issue 20, defect 4) ---------------------------------------------------------------
class InfiniteLossAtRound2(FedAvg):
    """In round 2 every client records a non-finite loss while its update stays finite."""

    def client_step(self, params, local, ctx):
        if ctx.info.round == 2:
            ctx.grad({k: v * float("inf") for k, v in params.items()})
        return super().client_step(params, local, ctx)


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_a_non_finite_loss_is_divergence_and_names_the_last_good_checkpoint(tmp_path, execution):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds=5, enable_checkpointing=True, callbacks=[checkpoint])
    with pytest.raises(DivergenceError, match="^round 2: client \\d+'s training loss is non-finite \\(nan\\).*last.ckpt") as info:
        trainer.fit(_module(InfiniteLossAtRound2(), execution=execution), datamodule=tiny_datamodule())
    assert "\n" not in str(info.value)
    good = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert good["global_step"] == 2


def test_no_checkpoint_is_written_from_a_non_finite_state(tmp_path):
    module = _module(FedAvg())
    trainer = tiny_trainer(tmp_path, rounds=1)
    trainer.fit(module, datamodule=tiny_datamodule())
    with torch.no_grad():
        next(module.model.parameters())[0, 0] = float("inf")
    with pytest.raises(DivergenceError, match="no checkpoint is written from a non-finite state \\(x/"):
        trainer.save_checkpoint(tmp_path / "bad.ckpt")
    assert not (tmp_path / "bad.ckpt").exists()


@pytest.mark.parametrize(
    "faults", [ClientFaults(dropout=0.3, straggler=0.5), ClientFaults(straggler=1.0, straggler_min_fraction=1.0), ClientFaults(dropout=0.99), ClientFaults()]
)
def test_a_rounds_draws_are_each_clients_draw(faults):
    """``draws`` (a round's clients at once) gives every client's ``draw``, for few clients (seeds derived one by one)
    and many (derived vectorised), seeds at the 32- and 63-bit edges, repeated seeds and K from 1."""
    rng = np.random.default_rng(0)
    edges = [0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1]
    seeds = edges + rng.integers(0, 2**63 - 1, 400, dtype=np.int64).tolist() + rng.integers(0, 2**32, 100).tolist() + [5] * 20
    steps = rng.integers(1, 60, len(seeds)).tolist()
    for lo, hi in [(0, 0), (0, 1), (0, 7), (7, 22), (0, len(seeds))]:
        assert faults.draws(seeds[lo:hi], steps[lo:hi]) == [faults.draw(s, k) for s, k in zip(seeds[lo:hi], steps[lo:hi])]
