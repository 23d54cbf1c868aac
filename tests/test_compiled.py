"""Compiled client execution (``compile=True``): the same results as eager execution, to float tolerance.

Compiling with inductor costs seconds to minutes a program on a small CPU, so the sweep over every
built-in algorithm compiles with the ``eager`` backend (dynamo's single traced graph of the rule,
the functional gradient and vmap, run by eager kernels; ``aot_eager`` elsewhere adds AOT autograd's
functionalisation, inductor's input); the generated-code path (inductor)
is checked on FedAvg (sequential), FedSAM (a reduction in the rule, batched under vmap) and SCAFFOLD
(client state and a server payload; the bitwise resume).
"""

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import fl_lightning.algorithms as A
from datamodules import Dirichlet
from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms.base import Algorithm
from fl_lightning.executors import BatchedExecutor, SequentialExecutor
from fl_lightning.executors.batched import padded_clients
from fl_lightning.executors.compiled import CompileError
from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.core.local_loss import defines_local_loss
from lightning.pytorch.callbacks import ModelCheckpoint
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

RTOL, ATOL = 1e-5, 1e-6  # float32, a few ulps of the model's parameters after 2 rounds
ALGORITHMS = sorted(n for n in A.__all__ if isinstance(getattr(A, n), type) and issubclass(getattr(A, n), Algorithm) and n != "Algorithm")


def _client_rule(name: str) -> tuple:
    """The methods a compiled client program traces (FedAdam's are FedAvg's: the same program)."""
    cls = getattr(A, name)
    return tuple(getattr(cls, m, None) for m in ("client_state_init", "broadcast", "client_init", "client_step", "client_finish", "local_loss", "personal_finish"))


_BY_RULE: dict[tuple, list[str]] = {}
for _name in ALGORITHMS:
    _BY_RULE.setdefault(_client_rule(_name), []).append(_name)
REGISTRY = sorted(min(names, key=lambda n: len(getattr(A, n).__mro__)) for names in _BY_RULE.values())  # one per client rule, its base
SWEEP_BACKEND = "eager"
PERSONAL = {"FedAvgP", "FedAlt", "FedSim", "ScaffoldP"}  # partial personalization: a personal head


def _fit(tmp_path, algorithm, execution, rounds=2, faults=ClientFaults(), local=None, data=None, model=None, **trainer):
    torch.manual_seed(0)
    personal = ["net.3"] if type(algorithm).__name__ in PERSONAL else []
    module = FederatedModule(
        (model or (lambda: MLP(8, 3, hidden=[16])))(), algorithm, local or LocalTraining(lr=0.1, steps=3, batch_size=8, weight_decay=1e-3),
        execution=execution, faults=faults, personal=personal,
    )  # fmt: skip
    trainer = tiny_trainer(tmp_path, rounds, **trainer)
    trainer.fit(module, datamodule=data or tiny_datamodule())
    return module


def _assert_close(eager, compiled, rtol=RTOL, atol=ATOL):
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    sa, sb = eager.store.state_dict(), compiled.store.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=atol)
    for key in ("train/loss", "train/acc"):  # the per-step records' means
        torch.testing.assert_close(eager.trainer.callback_metrics[key], compiled.trainer.callback_metrics[key], rtol=rtol, atol=atol)


_EAGER: dict[str, FederatedModule] = {}


def _eager(tmp_path, name):
    """The eager sequential reference of ``name``, fitted once per test process (only read)."""
    if name not in _EAGER:
        _EAGER[name] = _fit(tmp_path, _algorithm(name), "sequential")
    return _EAGER[name]


def _algorithm(name):
    return A.FedAvgSVRG(snapshots=1, inner_steps=3) if name == "FedAvgSVRG" else getattr(A, name)()


FULL_GRADIENTS = {"FedAvgSVRG", "FedALA"}  # read ctx.full_grad (the client's whole set): declared reason, run eagerly
READS_STEP = {"FedAlt", "FedAvgSVRG"}  # client_step reads ctx.step / ctx.num_steps: the round program in step mode


def _executor(kind, **kw):
    return (BatchedExecutor if kind == "batched" else SequentialExecutor)(compile=True, **kw)


@pytest.mark.parametrize("unit", ["step", "round"])
@pytest.mark.parametrize("kind", ["sequential", "batched"])
@pytest.mark.parametrize("name", REGISTRY)
def test_every_algorithm_compiled_equals_eager(tmp_path, name, kind, unit):
    eager = _eager(tmp_path, name)
    executor = _executor(kind, backend=SWEEP_BACKEND, compile_unit=unit)
    compiled = _fit(tmp_path, _algorithm(name), executor)
    _assert_close(eager, compiled)
    inner = executor.sequential if kind == "batched" else executor
    fallbacks = {**inner.fallbacks, **getattr(executor, "compile_fallbacks", {})}
    if name in FULL_GRADIENTS:  # full local gradients: declared, eager
        assert any("full local gradients" in reason for reason in fallbacks)
    else:  # an algorithm's own objective (local_loss: MOON, FedNTD, FedLC, FedRS, FedDecorr, ...) is compiled too
        assert not fallbacks, fallbacks
        assert executor.compile_seconds > 0
    unit_fallbacks = {**executor.programs.unit_fallbacks, **inner.programs.unit_fallbacks}  # the round program for a declared reason
    assert bool(unit_fallbacks) == (name in READS_STEP and unit == "step"), unit_fallbacks  # batched's sequential rounds: the same unit


@pytest.mark.parametrize("name, kind, unit", [("FedAvg", "sequential", "step"), ("FedAvg", "sequential", "round"), ("FedSAM", "batched", "round")])
def test_inductor_compiled_equals_eager(tmp_path, name, kind, unit):
    eager = _fit(tmp_path, getattr(A, name)(), "sequential")
    executor = _executor(kind, compile_unit=unit)
    compiled = _fit(tmp_path, getattr(A, name)(), executor)
    _assert_close(eager, compiled)
    assert not executor.compile_fallbacks if kind == "batched" else not executor.fallbacks
    assert compiled.trainer.callback_metrics["time/compile_s"] > 0


def test_compiled_runs_repeat_bitwise_and_variants_are_bounded(tmp_path):
    """Dropout changes S every round: padded to a power of two (at most the cohort of 4), S in 0..4 needs
    at most 3 programs (S = 1, 2, 4), and two runs with the same seed are bitwise equal (inductor's bitwise repeatability:
    ``test_compiled_resume_is_bitwise_identical``)."""
    runs = []
    for _ in range(2):
        executor = BatchedExecutor(compile=True, backend="aot_eager")
        module = _fit(tmp_path, A.FedAvg(), executor, rounds=8, faults=ClientFaults(dropout=0.4), data=tiny_datamodule(clients_per_round=4))
        assert executor.programs.compiled <= 3 and executor.sequential.programs.compiled == 0
        runs.append(module)
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b)
    assert {key[1] for key in executor.programs.variants} <= {1, 2, 4}


def test_padded_rounds_equal_eager_execution(tmp_path, monkeypatch):
    """Rounds whose clients are padded up to the program's size (dropout: 3 of a cohort of 4 run as 4) and the
    padding cut off again give what eager sequential execution gives (SCAFFOLD: a client state and a local state)."""
    import fl_lightning.executors.batched as batched

    cut = []
    unpad = batched._unpad_clients
    monkeypatch.setattr(batched, "_unpad_clients", lambda extra, tree: cut.append(extra) or unpad(extra, tree))
    settings = dict(rounds=8, faults=ClientFaults(dropout=0.4), data=tiny_datamodule(clients_per_round=4))
    eager = _fit(tmp_path, A.SCAFFOLD(), "sequential", **settings)
    compiled = _fit(tmp_path, A.SCAFFOLD(), BatchedExecutor(compile=True, backend=SWEEP_BACKEND), **settings)
    assert any(cut), "no round was padded: the test does not reach the cut"
    _assert_close(eager, compiled)


def test_stacked_clients_are_padded_to_the_cohort_at_most():
    """A fixed cohort (UniformSampling) runs unpadded; fewer clients (dropout) pad to a power of two
    below it: at most log2(S) + 2 programs; without a fixed cohort, powers of two."""
    assert [padded_clients(n, 10) for n in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10]
    assert padded_clients(50, 50) == 50 and padded_clients(200, 200) == 200 and padded_clients(33, 50) == 50
    assert [padded_clients(n, None) for n in (1, 3, 5, 10)] == [1, 4, 8, 16]
    assert padded_clients(12, 10) == 16  # more than the cohort (not from a fixed sampler): a power of two
    assert len({padded_clients(n, 50) for n in range(1, 51)}) <= 50 .bit_length() + 1


def test_a_fixed_cohort_compiles_one_unpadded_program(tmp_path):
    executor = BatchedExecutor(compile=True, backend="aot_eager")
    _fit(tmp_path, A.FedAvg(), executor, rounds=3, data=tiny_datamodule(clients_per_round=3))
    assert executor.programs.compiled == 1 and {key[1] for key in executor.programs.variants} == {3}


def test_compiled_resume_is_bitwise_identical(tmp_path):
    """6 rounds straight == 3 rounds + checkpoint + a fresh executor resumed to 6 (a decaying lr, stragglers)."""
    local = LocalTraining(lr=0.1, steps=3, batch_size=8, lr_decay=0.9)
    faults = ClientFaults(straggler=0.5)

    def run(directory, rounds, ckpt=None):
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), A.SCAFFOLD(), local, execution=SequentialExecutor(compile=True), faults=faults)
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=ckpt)
        return module

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "c", 6, ckpt=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert straight.store.equal(resumed.store)


class DataDependent(nn.Module):
    """A forward that branches on a tensor's value: not traceable as one graph."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x):
        out = self.linear(x)
        return out if out.sum() > -1e9 else -out


def test_an_untraceable_model_runs_eagerly_with_a_logged_reason(tmp_path, caplog):
    eager = _fit(tmp_path, A.FedAvg(), "sequential", model=DataDependent)
    executor = SequentialExecutor(compile=True, backend="aot_eager")
    with caplog.at_level(logging.WARNING, logger="fl_lightning.executors.sequential"):
        compiled = _fit(tmp_path, A.FedAvg(), executor, model=DataDependent)
    assert "compiled execution falls back to eager: the rule or model cannot be compiled" in caplog.text
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        assert torch.equal(a, b)


@torch._dynamo.register_backend
def failing_backend(graph, example_inputs):
    raise RuntimeError("the C++ compiler is missing\nand a second line")


def test_any_other_compile_error_stops_the_run_with_one_line(tmp_path):
    with pytest.raises(CompileError) as raised:
        _fit(tmp_path, A.FedAvg(), SequentialExecutor(compile=True, backend="failing_backend"))
    assert "\n" not in str(raised.value) and "compiling the local steps failed" in str(raised.value)


def test_compiled_execution_detects_divergence(tmp_path):
    from fl_lightning.reliability.faults import DivergenceError

    with pytest.raises(DivergenceError, match="non-finite"):
        _fit(tmp_path, A.FedAvg(), SequentialExecutor(compile=True, backend="aot_eager"), local=LocalTraining(lr=1e30, steps=3, batch_size=8))


@pytest.mark.parametrize("kwargs, match", [
    (dict(compile="yes"), "execution.compile must be true or false"),
    (dict(compile=True, max_variants=0), "execution.max_variants must be an integer >= 1"),
    (dict(compile=True, backend="nvcc"), "execution.backend must be one of"),
    (dict(compile=True, compile_unit="epoch"), "execution.compile_unit must be one of"),
])  # fmt: skip
@pytest.mark.parametrize("executor", [SequentialExecutor, BatchedExecutor])
def test_bad_compile_settings_are_rejected(kwargs, match, executor):
    with pytest.raises(ValueError, match=match):
        executor(**kwargs)


def test_compiled_quickstart_through_the_cli(tmp_path):
    """``configs/quickstart_compiled.yaml`` runs from the CLI; compile time in the result line and as a metric."""
    import csv

    from tests.test_cli import ROOT, fl_lightning

    proc = fl_lightning(
        "fit", "--config", str(ROOT / "configs" / "quickstart_compiled.yaml"), "--trainer.max_steps", "2",
        "--trainer.val_check_interval", "2", "--model.local.steps", "2", "--model.execution.init_args.backend", "aot_eager",
        cwd=tmp_path,
    )  # fmt: skip
    assert "s compiling)" in proc.stdout + proc.stderr
    with open(tmp_path / "runs" / "quickstart_compiled" / "version_0" / "metrics.csv") as f:
        compile_s = [float(r["time/compile_s"]) for r in csv.DictReader(f) if r.get("time/compile_s")]
    assert compile_s and compile_s[0] > 0 and compile_s[-1] >= compile_s[0]


class ReadsClientId(A.FedAvg):
    """FedAvg whose step reads ``ctx.client_id`` (a number per client: not a compiled program's input)."""

    elementwise = True

    def client_step(self, params, local, ctx):
        ctx.client_id
        return super().client_step(params, local, ctx)


@pytest.mark.parametrize("kind", ["sequential", "batched"])
def test_a_rule_reading_the_client_id_runs_eagerly_with_a_reason(tmp_path, caplog, kind):
    eager = _fit(tmp_path, ReadsClientId(), "sequential")
    executor = _executor(kind, backend="eager")
    with caplog.at_level(logging.WARNING):
        compiled = _fit(tmp_path, ReadsClientId(), executor)
    assert "ReadsClientId reads ctx.client_id in its local steps" in caplog.text
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        assert torch.equal(a, b)


# ---- the compiled unit (compile_unit: step | round) ----------------------------------------------
@pytest.mark.parametrize("kind", ["sequential", "batched"])
def test_per_step_and_unrolled_programs_agree(tmp_path, kind):
    """One step a program called K times and the K steps unrolled into one program: the same model, client
    states and step records (SCAFFOLD: a local state, a client state and a server payload; a decaying step size)."""
    local = LocalTraining(lr=0.1, steps=4, batch_size=8, weight_decay=1e-3, lr_decay=0.9)
    runs = {unit: _fit(tmp_path, A.SCAFFOLD(), _executor(kind, backend="aot_eager", compile_unit=unit), rounds=3, local=local)
            for unit in ("step", "round")}  # fmt: skip
    _assert_close(runs["round"], runs["step"])


def test_the_units_by_default_and_in_the_compiled_quickstart():
    """Both executors compile the K steps unrolled by default (their throughput: sequential compiled >= 1.5x the
    bare loop holds only with it); the compiled quickstart sets the per-step unit (half the compile time); batched
    execution's sequential rounds use its own unit."""
    import yaml

    assert SequentialExecutor(compile=True).programs.unit == "round"
    assert BatchedExecutor(compile=True).programs.unit == "round"
    assert BatchedExecutor(compile=True, compile_unit="step").sequential.programs.unit == "step"
    config = yaml.safe_load((Path(__file__).parents[1] / "configs" / "quickstart_compiled.yaml").read_text())
    assert config["model"]["execution"]["init_args"] == {"compile": True, "compile_unit": "step"}


class ReadsStep(A.FedAvg):
    """FedAvg whose step size halves after the first step: a schedule on ``ctx.step`` (a Python number)."""

    elementwise = True

    def client_step(self, params, local, ctx):
        _, grad = ctx.grad(params)
        scale = 1.0 if ctx.step == 0 else 0.5
        return {k: p - scale * ctx.lr * grad[k] for k, p in params.items()}, local


@pytest.mark.parametrize("algorithm", [ReadsStep, A.FedAlt])
def test_a_rule_reading_the_step_index_runs_the_unrolled_program(tmp_path, caplog, algorithm):
    """The per-step program does not take the step index (it would be a constant: a program per step): a
    client_step reading ctx.step or ctx.num_steps runs the round program, with the reason logged once."""
    eager = _fit(tmp_path, algorithm(), "sequential")
    executor = SequentialExecutor(compile=True, backend="aot_eager", compile_unit="step")
    with caplog.at_level(logging.WARNING, logger="fl_lightning.executors.compiled"):
        compiled = _fit(tmp_path, algorithm(), executor)
    _assert_close(eager, compiled)
    name = algorithm.__name__
    assert caplog.text.count("compiled execution falls back to the unrolled round program") == 1
    assert f"{name}'s client_step reads ctx." in caplog.text
    assert executor.programs.unit == "round" and not executor.fallbacks
    assert {k for k, *_ in executor.programs.variants} == {3}  # the round program's K, no step program kept


def test_step_programs_serve_every_straggler(tmp_path):
    """Stragglers run fewer steps: the round unit compiles one program per distinct K, the step unit one for all
    (plus one with a dynamic batch where a client has fewer samples than the batch)."""
    faults, local = ClientFaults(straggler=0.6), LocalTraining(lr=0.1, steps=6, batch_size=8)
    data = dict(num_clients=8, clients_per_round=4)
    programs = {}
    for unit in ("step", "round"):
        executor = SequentialExecutor(compile=True, backend="aot_eager", compile_unit=unit)
        _fit(tmp_path, A.FedAvg(), executor, rounds=6, faults=faults, local=local, data=tiny_datamodule(**data))
        programs[unit] = executor.programs
    steps, rounds = programs["step"], programs["round"]
    assert {k for k, *_ in steps.variants} == {"step"} and steps.compiled == len(steps.variants) <= 2
    assert len({k for k, *_ in rounds.variants}) > 1  # several K: one round program each
    assert rounds.compiled == len(rounds.variants) > steps.compiled


def test_local_epochs_two_steps_a_call_sequentially(tmp_path):
    """``steps_per_call=2`` under sequential compiled execution with ``local.epochs``: two consecutive batches of the
    same shape one call of the pair program (a pass's short last batch alone, or with another short one); the same
    steps as one step a call in fewer calls; eager execution's results."""
    from fl_lightning.executors.compiled import one_step, two_steps

    local = LocalTraining(lr=0.1, steps=None, epochs=2, batch_size=8)
    data = lambda: tiny_datamodule(num_clients=8, clients_per_round=4, partition=Dirichlet(0.5, min_size=5))  # noqa: E731
    eager = _fit(tmp_path, A.SCAFFOLD(), "sequential", rounds=3, local=local, data=data())
    runs = {}
    for per_call in (1, 2):
        executor, calls = SequentialExecutor(compile=True, backend="eager", steps_per_call=per_call), []
        guarded = executor.programs._guarded

        def counted(unit_fn, dynamic, new, args, guarded=guarded, calls=calls):
            calls.append((unit_fn, len(args[10]) if unit_fn is two_steps else 1, dynamic))
            return guarded(unit_fn, dynamic, new, args)

        executor.programs._guarded = counted
        _assert_close(eager, _fit(tmp_path, A.SCAFFOLD(), executor, rounds=3, local=local, data=data()))
        assert not executor.fallbacks
        runs[per_call] = (calls, executor.programs.variants)
    (single, single_variants), (paired, paired_variants) = runs[1], runs[2]
    assert {fn for fn, *_ in single} == {one_step} and {fn for fn, *_ in paired} == {one_step, two_steps}
    assert sum(n for _, n, _ in paired) == len(single) and len(paired) < len(single)  # every step once, fewer calls
    assert {k for k, _ in paired_variants} == {"step", "pair"} and {k for k, _ in single_variants} == {"step"}


def test_short_batches_of_every_size_share_the_dynamic_step_program(tmp_path):
    """A pass's short last batches, of many sizes and at many offsets in the round's gathered block, run the one
    dynamic variant of the step program: it compiled again for each new storage offset, base size, or size equal to a
    parameter's dimension (duck shaping) before (9 graphs on mlp_realistic); at most one more graph for a batch of one
    row, which torch specialises."""
    local = LocalTraining(lr=0.1, steps=None, epochs=1, batch_size=8)
    data = tiny_datamodule(num_clients=12, clients_per_round=6, partition=Dirichlet(0.5, min_size=9))
    executor = SequentialExecutor(compile=True, backend="eager")
    _fit(tmp_path, A.FedAvg(), executor, rounds=6, local=local, data=data)
    sizes = {len(data.client_train[c]) % 8 for c in range(12)} - {0}
    assert len(sizes) >= 4  # the clients' short batch sizes (a round trains 6 of the 12)
    assert executor.programs.variants == {("step", False), ("step", True)} and not executor.fallbacks
    assert executor.programs.compiled <= 2 + (1 in sizes)


@pytest.mark.parametrize("unit", ["auto", "step"])
def test_local_epochs_run_the_step_program_sequentially(tmp_path, unit):
    """``local.epochs`` (each client its own K, a pass's last batch short) under sequential compiled execution: the
    step program, full batches on its static variant and short ones on its dynamic one (two programs in all),
    with eager execution's results; ``compile_unit: round`` (a program per K) declines with a one-line reason."""
    local = LocalTraining(lr=0.1, steps=None, epochs=2, batch_size=8)
    data = lambda: tiny_datamodule(num_clients=8, clients_per_round=4, partition=Dirichlet(0.5, min_size=5))  # noqa: E731
    eager = _fit(tmp_path, A.SCAFFOLD(), "sequential", rounds=3, local=local, data=data())
    executor = SequentialExecutor(compile=True, backend="eager", compile_unit=unit)
    compiled = _fit(tmp_path, A.SCAFFOLD(), executor, rounds=3, local=local, data=data())
    _assert_close(eager, compiled)
    assert not executor.fallbacks and executor.programs.variants == {("step", False), ("step", True)}
    declined = SequentialExecutor(compile=True, backend="eager", compile_unit="round")
    _fit(tmp_path, A.SCAFFOLD(), declined, rounds=1, local=local, data=data())
    assert len(declined.fallbacks) == 1 and "compile_unit: round" in next(iter(declined.fallbacks))
