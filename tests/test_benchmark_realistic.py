"""benchmarks/run.py's realistic workloads: named on the command line, the bare loop's schedule is the
framework's own, and stacked_fraction / padding_waste read the executor (they time nothing)."""

import importlib.util
from collections import Counter
from pathlib import Path

import lightning as L
import pytest

ROOT = Path(__file__).resolve().parents[1]
REALISTIC = ["mlp_realistic", "cnn_realistic", "lora_realistic"]


def _runner():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_realistic_workloads_are_listed_and_accepted(capsys):
    run = _runner()
    with pytest.raises(SystemExit) as shown:
        run.parse_args(["--help"])
    assert shown.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in REALISTIC)
    assert run.parse_args(["--workloads", ",".join(REALISTIC)]).workloads.split(",") == REALISTIC
    assert set(REALISTIC) <= set(run.parse_args([]).workloads.split(","))  # in the default run
    with pytest.raises(SystemExit) as refused:
        run.parse_args(["--workloads", "mlp_realistc"])
    assert refused.value.code == 2


def test_the_bare_schedule_is_the_work_the_framework_dispatches():
    """Every round's clients and step budgets (after the straggler draw) as FederatedModule hands them out."""
    run = _runner()
    from benchmarks import realistic
    from fl_lightning import FedAvg, FederatedModule

    spec, rounds = run.WORKLOADS["mlp_realistic"], 3
    model, data = run.build("mlp_realistic", 8)
    planned = [[(w.client, w.steps) for w in work] for work in realistic.schedule(data, spec, rounds)]
    module = FederatedModule(model, FedAvg(), realistic.local_training(spec, run.LR), faults=realistic.faults(spec))
    dispatched, run_summed = [], module.executor.run_summed

    def spy(tasks, info, runtime):
        dispatched.append([(t.client_id, t.num_steps) for t in tasks])
        return run_summed(tasks, info, runtime)

    module.executor.run_summed = spy  # FedAvg's aggregate is linear: every round goes through run_summed
    trainer = L.Trainer(max_steps=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert dispatched == planned
    steps = [s for work in planned for _, s in work]
    full = [data.num_local_steps(c, spec["batch"], None, spec["epochs"]) for work in planned for c, _ in work]
    assert len(set(full)) > 1 and any(s < f for s, f in zip(steps, full))  # unequal K_i, and stragglers
    assert run.client_steps("mlp_realistic", 8, rounds) == sum(steps[len(planned[0]) :])  # the timed rounds only


def test_stacking_reads_stats_else_the_fallbacks():
    from benchmarks.realistic import stacking
    from fl_lightning.executors import BatchedExecutor, SequentialExecutor, resolve_executor

    class Stats:
        stats = {"rounds": 10, "stacked_rounds": 10, "real_work": 300, "padded_work": 100}

        def __init__(self, inner):
            self.inner = inner

    assert stacking(Stats(None), 10) == (1.0, 0.25)
    batched = resolve_executor(BatchedExecutor())
    batched.inner.__dict__.pop("stats", None)  # an executor that keeps no stats: its fallbacks tell
    assert stacking(batched, 8) == (1.0, 0.0)
    batched.inner.fallbacks = Counter({"stragglers run fewer local steps than the others": 6})
    assert stacking(batched, 8) == (0.25, 0.0)
    batched.inner.fallbacks = Counter({"local.epochs gives clients different numbers of steps": 8})
    assert stacking(batched, 8) == (0.0, None)
    assert stacking(resolve_executor(SequentialExecutor()), 8) == (0.0, None)


def test_realistic_rows_carry_stacked_fraction_and_padding_waste(monkeypatch):
    run = _runner()
    monkeypatch.setattr(run, "_quiet", lambda: None)  # keep this process's warning and log settings
    monkeypatch.setitem(run.WORKLOADS, "cnn_realistic", {**run.WORKLOADS["cnn_realistic"], "plan": [4]})
    rows = run.worker(["cnn_realistic"], ["bare", "one_batch", "sequential", "batched"], rounds={"cnn_realistic": 2}, repeats=1)
    by = {row["execution"]: row for row in rows}
    assert list(by) == ["bare", "sequential", "batched"]  # one_batch: not defined for unequal local work
    assert all(row["client_steps_per_s"] > 0 for row in rows)
    assert (by["bare"]["stacked_fraction"], by["bare"]["padding_waste"]) == (None, None)
    assert (by["sequential"]["stacked_fraction"], by["sequential"]["padding_waste"]) == (0.0, None)
    stacked, waste = by["batched"]["stacked_fraction"], by["batched"]["padding_waste"]
    assert 0.0 <= stacked <= 1.0 and (waste is None) == (stacked == 0.0) and (waste is None or 0.0 <= waste < 1.0)
