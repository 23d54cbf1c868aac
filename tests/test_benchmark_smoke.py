"""The benchmark runners work on every workload (a few rounds; they measure nothing here)."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runner():
    return _load("run")


@pytest.mark.parametrize("workload", ["mlp", "mlp400", "cnn", "lora"])
def test_worker_rows_have_the_documented_fields(workload, tmp_path, monkeypatch):
    monkeypatch.setenv("FL_BENCH_TEXT_DIR", str(tmp_path / "text"))
    run = _runner()
    monkeypatch.setattr(run, "_quiet", lambda: None)  # keep this process's warning and log settings
    monkeypatch.setitem(run.WORKLOADS, workload, {**run.WORKLOADS[workload], "plan": [2]})
    executions = ["bare", "one_batch", "sequential", "batched"]
    rows = run.worker([workload], executions, rounds={workload: 2}, repeats=1)
    assert [r["execution"] for r in rows] == executions
    for row in rows:
        assert set(row) == {"workload", "execution", "clients_per_round", "client_steps_per_s", "peak_rss_mb"}
        assert row["client_steps_per_s"] > 0 and row["peak_rss_mb"] > 0


def test_results_name_the_machine_and_the_date():
    run = _runner()
    info = run.machine()
    assert info["cores"] >= 1 and info["cpu"] and info["torch"]
    out = run.default_out({**info, "cpu": "Intel(R) Xeon(R) Gold 6430", "cores": 16}, quick=True)
    assert out.startswith("benchmarks/results/intel-r-xeon-r-gold-6430-16cpu-quick-") and out.endswith(".json")
    flower = run.default_out({**info, "cpu": "AMD EPYC", "cores": 2}, quick=False, prefix="flower")
    assert flower.startswith("benchmarks/results/flower-amd-epyc-2cpu-") and flower.endswith(".json")


def test_mlp400_keeps_the_data_per_client_of_mlp():
    run = _runner()
    mlp, wide = run.WORKLOADS["mlp"], run.WORKLOADS["mlp400"]
    assert wide["num_clients"] >= 2 * max(wide["plan"]) and 200 in wide["plan"]
    assert wide["samples"] / wide["num_clients"] == mlp["samples"] / mlp["num_clients"]


def test_tree_memory_sums_this_process_and_its_children():
    memory = _load("tree_memory")
    own = memory.tree_rss_bytes()
    assert own > 0 and memory._tree_rss_proc(os.getpid()) > 0
    with memory.PeakTreeMemory(interval=0.01) as peak:
        pass
    assert peak.peak_mb >= own / 2**20 / 2


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_flower_compare_fl_lightning_side(execution, monkeypatch):
    compare = _load("flower_compare")
    monkeypatch.setattr(compare, "_quiet", lambda: None)  # keep this process's warning and log settings
    import time

    result = compare.measure(execution, rounds=3, clients_per_round=2, actors=1, launched=time.time())
    assert set(result) == {"per_client_fit_ms", "startup_s", "own_peak_rss_mb"}
    assert result["per_client_fit_ms"] > 0 and result["own_peak_rss_mb"] > 0
    result["peak_tree_mb"] = result["own_peak_rss_mb"]  # launch() adds it from outside
    rows = compare.summarize({"flower": [{"error": "flwr is not installed"}], execution: [result, result]})
    assert rows[0] == {"execution": "flower", "runs": 0, "error": "flwr is not installed"}
    assert rows[1]["runs"] == 2 and "flower_over_this" not in rows[1]
    flower = {**result, "per_client_fit_ms": 2 * result["per_client_fit_ms"]}
    assert compare.summarize({"flower": [flower], execution: [result]})[1]["flower_over_this"]["per_client_fit_ms"] == 2.0


def test_flower_compare_launches_a_measured_process():
    compare = _load("flower_compare")
    result = compare.launch("sequential", rounds=2, clients_per_round=2, actors=1, timeout=300)
    assert "error" not in result, result["error"]
    assert result["peak_tree_mb"] >= result["own_peak_rss_mb"] / 2 > 0
    assert compare.launch("nonsense", rounds=2, clients_per_round=2, actors=1, timeout=300)["error"]


def test_flower_compare_flower_side():
    pytest.importorskip("flwr.simulation")
    pytest.importorskip("ray")
    compare = _load("flower_compare")
    result = compare.launch("flower", rounds=2, clients_per_round=2, actors=1, timeout=300)
    assert "error" not in result, result["error"]
    assert result["per_client_fit_ms"] > 0 and result["inside_client_ms"] > 0 and result["peak_tree_mb"] > 0


def test_flower_compare_names_the_first_error_of_a_log():
    compare = _load("flower_compare")
    log = (
        "INFO: starting\nTraceback (most recent call last):\n    raise ValueError(\n"
        "ValueError: ActorPool is empty.\nRuntimeError: Simulation Runtime crashed.\n"
    )
    assert compare._first_exception(log) == "ValueError: ActorPool is empty."
    assert compare._first_exception("all fine\n") is None


def test_round_floor_times_an_empty_lightning_round():
    """benchmarks/round_floor.py: the milliseconds of a round that only steps the server optimizer (positive, finite)."""
    from benchmarks.round_floor import floor_ms

    ms = floor_ms(150)
    assert 0.0 < ms < 1000.0
