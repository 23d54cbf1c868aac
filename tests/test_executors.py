"""The executor contract: injectable executors, safe capabilities, no silent fallback."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.algorithms import FAdamET, FedAvgP, LocalAdam
from fl_lightning.algorithms.base import ClientContext, ClientIdUnavailable, RoundInfo, declares_capability
from fl_lightning.commands.cli import build_cli
from fl_lightning.executors import BatchedExecutionError, BatchedExecutor, Executor, SequentialExecutor
from models import MLP
from tests.test_execution import _assert_same_training, _fit

ROOT = Path(__file__).resolve().parents[1]


class ReversedExecutor(Executor):
    """A user's executor: runs the tasks last to first, returns results in task order."""

    runs = 0

    def __init__(self) -> None:
        self.sequential = SequentialExecutor()

    def run(self, tasks, info, runtime):
        ReversedExecutor.runs += 1
        return self.sequential.run(list(tasks)[::-1], info, runtime)[::-1]


def _cli(tmp_path, *extra):
    args = ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "2", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--trainer.enable_progress_bar", "false",
            "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path), *extra]  # fmt: skip
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli.model


def test_a_custom_executor_given_by_class_path_in_yaml_runs_rounds(tmp_path):
    config = tmp_path / "executor.yaml"
    config.write_text("model:\n  execution:\n    class_path: tests.test_executors.ReversedExecutor\n")
    custom = _cli(tmp_path, "--config", str(config))
    assert isinstance(custom.executor.inner, ReversedExecutor) and ReversedExecutor.runs == 2
    plain = _cli(tmp_path)
    for a, b in zip(plain.model.parameters(), custom.model.parameters()):
        assert torch.equal(a, b)


def test_no_engine_file_imports_the_lightning_module():
    """Only the CLI imports ``fl_lightning.engine.module`` at import time (``fl_lightning/__init__`` re-exports it lazily)."""
    offenders = []
    for path in (ROOT / "fl_lightning").rglob("*.py"):
        if path.name == "cli.py" or path.name == "module.py":
            continue
        for node in ast.parse(path.read_text()).body:  # module level only: TYPE_CHECKING blocks are ast.If
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "fl_lightning.engine.module" for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    for path in (ROOT / "fl_lightning" / "executors").glob("*.py"):  # executors import nothing of Lightning's trainer side
        imported = [n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith(("lightning.pytorch", "fl_lightning.engine.module", "datamodules"))], path


# ---- capabilities are declared by the class that writes the rule ----------------------------------------------
class ClippedFedAvg(FedAvg):
    """A user's FedAvg that clips each gradient to global norm <= max_norm (a reduction over all tensors)."""

    max_norm = 0.05

    def client_step(self, params, local, ctx):
        _, grad = ctx.grad(params)
        norm = torch.sqrt(sum((g * g).sum() for g in grad.values()))
        scale = torch.clamp(self.max_norm / (norm + 1e-12), max=1.0)
        return {k: p - ctx.lr * scale * grad[k] for k, p in params.items()}, local


def test_capabilities_are_not_inherited_by_a_subclass_that_rewrites_the_rule():
    assert declares_capability(FedAvg(), "elementwise") and declares_capability(FAdamET(), "elementwise")
    assert not declares_capability(ClippedFedAvg(), "elementwise")  # inherits elementwise = True, rewrites client_step
    assert declares_capability(LocalAdam(), "elementwise")
    assert not declares_capability(FedAvgP(), "elementwise")  # never declared


def test_a_fedavg_subclass_clipping_by_global_norm_batches_per_client(tmp_path):
    """Stacked, the norm would be taken over all clients at once; the rule must run per client."""
    mlp = lambda: MLP(8, 3, hidden=[16])  # noqa: E731
    local = LocalTraining(lr=0.5, steps=3, batch_size=8)
    seq = _fit(tmp_path, mlp, ClippedFedAvg, "sequential", local=local)
    bat = _fit(tmp_path, mlp, ClippedFedAvg, "batched", local=local)
    assert not bat.executor.inner.fallbacks
    _assert_same_training(seq, bat)
    plain = _fit(tmp_path, mlp, FedAvg, "sequential", local=local)
    assert not all(torch.allclose(a, b) for a, b in zip(plain.model.parameters(), seq.model.parameters()))  # clipping acts


def test_client_id_raises_where_clients_run_stacked():
    ctx = ClientContext(torch.tensor([3, 5]), {}, {}, RoundInfo(0, 0.1, 10), num_steps=1)
    with pytest.raises(ClientIdUnavailable, match="ctx.client"):
        ctx.client_id
    assert ClientContext(3, {}, {}, RoundInfo(0, 0.1, 10), num_steps=1).client_id == 3


class IdStepFedAvg(FedAvg):
    """Reads the client id in every local step (client-dependent step size)."""

    elementwise = True

    def client_step(self, params, local, ctx):
        _, grad = ctx.grad(params)
        lr = ctx.lr * (1 + ctx.client_id % 2)
        return {k: p - lr * grad[k] for k, p in params.items()}, local


def test_a_rule_reading_the_client_id_in_its_steps_runs_sequentially_with_a_reason(tmp_path):
    mlp = lambda: MLP(8, 3, hidden=[16])  # noqa: E731
    seq = _fit(tmp_path, mlp, IdStepFedAvg, "sequential")
    bat = _fit(tmp_path, mlp, IdStepFedAvg, "batched")
    assert list(bat.executor.inner.fallbacks) == ["IdStepFedAvg reads ctx.client_id in its local steps (ctx.client holds the ids)"]
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        assert torch.equal(a, b)


def test_a_crashing_batched_path_is_not_hidden_by_a_fallback(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise IndexError("a bug in the batched path")

    monkeypatch.setattr(BatchedExecutor, "_elementwise_rule", broken)
    with pytest.raises(BatchedExecutionError, match="a bug in the batched path"):
        _fit(tmp_path, lambda: MLP(8, 3, hidden=[16]), FedAvg, "batched")


def test_personal_lr_follows_the_local_lr_schedule():
    local = LocalTraining(lr=0.4, personal_lr=0.1, lr_schedule="inv_sqrt")
    assert [local.personal_lr_at(t) for t in range(3)] == [0.1 / (t + 1) ** 0.5 for t in range(3)]
    decayed = LocalTraining(lr=0.4, personal_lr=0.1, lr_decay=0.5)
    assert decayed.personal_lr_at(2) == 0.1 * 0.25 and decayed.lr_at(2) == 0.4 * 0.25
