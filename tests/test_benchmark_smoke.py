"""The benchmark runner works on every workload (a few rounds; it measures nothing here)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("workload", ["mlp", "cnn", "lora"])
def test_worker_rows_have_the_documented_fields(workload, tmp_path, monkeypatch):
    monkeypatch.setenv("FL_BENCH_TEXT_DIR", str(tmp_path / "text"))
    run = _runner()
    monkeypatch.setattr(run, "_quiet", lambda: None)  # keep this process's warning and log settings
    monkeypatch.setitem(run.WORKLOADS, workload, {**run.WORKLOADS[workload], "plan": [2]})
    rows = run.worker([workload], ["bare", "sequential", "batched"], rounds={workload: 2}, repeats=1)
    assert [r["execution"] for r in rows] == ["bare", "sequential", "batched"]
    for row in rows:
        assert set(row) == {"workload", "execution", "clients_per_round", "client_steps_per_s", "peak_rss_mb"}
        assert row["client_steps_per_s"] > 0 and row["peak_rss_mb"] > 0


def test_results_name_the_machine_and_the_date():
    run = _runner()
    info = run.machine()
    assert info["cores"] >= 1 and info["cpu"] and info["torch"]
    out = run.default_out({**info, "cpu": "Intel(R) Xeon(R) Gold 6430", "cores": 16}, quick=True)
    assert out.startswith("benchmarks/results/intel-r-xeon-r-gold-6430-16cpu-quick-") and out.endswith(".json")
