"""The compiled round (``BatchedExecutor(compile=True, compile_round=True)``, fl_lightning/executors/round_program.py):
the clients, the aggregate and the server step as one program equal the eager batched round to float tolerance for
every algorithm it covers (the model, the server and optimizer states, the clients' states, the round's metrics);
the pure server steps equal torch.optim's; a resume is bitwise; a round it cannot run runs step by step, once said."""

from __future__ import annotations

import logging

import pytest
import torch

import fl_lightning.algorithms as A
from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.executors import BatchedExecutor
from fl_lightning.optim import Yogi
from fl_lightning.optim.functional import functional_step
from fl_lightning.rounds.stage import RoundStage
from models import MLP
from tests.conftest import (
    assert_resumes_bitwise,
    fit_checkpointed,
    fit_shipped_config,
    tiny_datamodule,
    tiny_trainer,
)

RTOL, ATOL = 1e-5, 1e-6
COVERED = {
    "FedAvg": A.FedAvg, "FedAvgM": A.FedAvgM, "FedAdam": A.FedAdam, "FedYogi": A.FedYogi,
    "FedAvgM nesterov": lambda: A.FedAvgM(nesterov=True), "FedProx": lambda: A.FedProx(mu=0.1), "SCAFFOLD": A.SCAFFOLD,
}  # fmt: skip


def _fit(tmp_path, algorithm, execution, rounds=3, **kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm, LocalTraining(lr=0.1, steps=3, batch_size=4), execution=execution, **kw)
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3))
    return module


def _compiled(backend="eager"):
    return BatchedExecutor(compile=True, compile_round=True, backend=backend)


@pytest.mark.parametrize("name", sorted(COVERED))
def test_the_compiled_round_equals_the_eager_batched_round(tmp_path, name):
    eager = _fit(tmp_path / "e", COVERED[name](), BatchedExecutor())
    executor = _compiled()
    compiled = _fit(tmp_path / "c", COVERED[name](), executor)
    program = executor.round_program
    assert program.rounds == 3 and not program.fallbacks, program.fallbacks  # every round one program
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    for (pa, sa), (pb, sb) in zip(eager.optimizers().optimizer.state.items(), compiled.optimizers().optimizer.state.items()):
        assert sa.keys() == sb.keys()
        for key in sa:  # torch.optim's own layout: a checkpoint of either resumes under the other
            torch.testing.assert_close(sa[key], sb[key], rtol=RTOL, atol=ATOL)
    for part, tensors in eager.server_state.items():
        for key, value in tensors.items():
            torch.testing.assert_close(value, compiled.server_state[part][key], rtol=RTOL, atol=ATOL)
    sa, sb = eager.store.state_dict(), compiled.store.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=RTOL, atol=ATOL)
    for key in ("train/loss", "train/acc", "train/consistency", "comm/round_bytes_up", "comm/cumulative_bytes"):
        torch.testing.assert_close(eager.trainer.callback_metrics[key], compiled.trainer.callback_metrics[key], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (lambda p: torch.optim.SGD(p, lr=0.5), {}),
        (lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), {}),
        (lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9, nesterov=True), {}),
        (lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.9, 0.99), eps=1e-3), {}),
        (lambda p: Yogi(p, lr=0.01, betas=(0.9, 0.99), eps=1e-3), {}),
    ],
    ids=["sgd", "momentum", "nesterov", "adam", "yogi"],
)
def test_the_pure_server_steps_equal_torch_optim(make, kwargs):
    torch.manual_seed(1)
    live = [torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64)), torch.nn.Parameter(torch.randn(5, dtype=torch.float64))]
    pure = [torch.nn.Parameter(p.detach().clone()) for p in live]
    eager, functional = make(live), make(pure)
    step = functional_step(functional)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in live]
        for p, g in zip(live, grads):
            p.grad = g.clone()
        eager.step()
        new, state = step.step([p.detach() for p in pure], grads, step.state())
        step.write(new, state)
    for a, b in zip(live, pure):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(live, pure):
        for key, value in eager.state[a].items():
            torch.testing.assert_close(value, functional.state[b][key], rtol=1e-12, atol=1e-12, check_dtype=False)
    assert functional_step(torch.optim.SGD(pure, lr=0.1, weight_decay=0.1)) == "the server optimizer SGD sets weight_decay"
    assert "has no functional form" in functional_step(torch.optim.RMSprop(pure, lr=0.1))


def test_a_compiled_round_resumes_bitwise(tmp_path):
    """4 rounds straight == 2 rounds + checkpoint + a fresh executor resumed to 4 (Adam's state written back by the program)."""

    def run(directory, rounds, ckpt=None):
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), A.FedAdam(), LocalTraining(lr=0.1, steps=3, batch_size=4), execution=_compiled())
        return fit_checkpointed(module, directory, rounds, tiny_datamodule(num_clients=6, clients_per_round=3), ckpt)

    straight, resumed = assert_resumes_bitwise(run, tmp_path, min_clients=0)
    assert resumed.executor.inner.round_program.rounds == 2
    for a, b in zip(straight.optimizers().optimizer.state.values(), resumed.optimizers().optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


class Observer(RoundStage):
    """A user's stage that declares nothing: the round runs step by step around it."""

    name = "observer"


def test_rounds_it_cannot_run_run_step_by_step_with_the_reason_once(tmp_path, caplog):
    executor = _compiled()
    with caplog.at_level(logging.WARNING):
        module = _fit(tmp_path / "s", A.FedRS(), executor)
    reasons = dict(executor.round_program.fallbacks)
    assert reasons == {"FedRS has its own local loss": 3}
    assert sum("falls back to the round step by step" in r.message for r in caplog.records) == 1
    assert module.trainer.global_step == 3
    user = _compiled()
    _fit(tmp_path / "u", A.FedAvg(), user, stages=[Observer()])
    assert user.round_program.rounds == 0  # the chain is not fusable: not even tried
    with pytest.raises(ValueError, match="execution.compile_round must be true or false, and true only with execution.compile true"):
        BatchedExecutor(compile_round=True)


def test_the_compiled_round_config_through_the_cli(tmp_path, monkeypatch, capsys):
    fit_shipped_config(tmp_path, monkeypatch, "quickstart_compiled_round", "--model.execution.init_args.backend", "eager")
    assert "2 of 2 rounds stacked, 2 as one compiled program" in capsys.readouterr().out

@torch._dynamo.register_backend
def round_failing_backend(graph, example_inputs):
    raise RuntimeError("the C++ compiler is missing\nand a second line")


def test_a_compiler_failure_stops_the_run_with_one_line(tmp_path):
    """Not a round that cannot be traced (that one runs step by step) but the compiler failing: it would fail again."""
    from fl_lightning.executors.compiled import CompileError

    with pytest.raises(CompileError) as raised:
        _fit(tmp_path, A.FedAvg(), _compiled("round_failing_backend"))
    assert "\n" not in str(raised.value) and "compiling the round failed" in str(raised.value) and "compile_round false" in str(raised.value)
