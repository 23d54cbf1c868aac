"""benchmarks/goals.py: each speed goal computed from result files' rows, hand-worked."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def goals():
    spec = importlib.util.spec_from_file_location("bench_goals", ROOT / "benchmarks" / "goals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(workload, execution, clients, steps_per_s, **extra):
    return {"workload": workload, "execution": execution, "clients_per_round": clients, "client_steps_per_s": steps_per_s, **extra}


MACHINE = {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0+cpu"}


def _document(rows, **extra):
    return {"machine": MACHINE, "date": "2026-11-27 12:00", "quick": True, "rows": rows, **extra}


def _by_goal(report):
    return {entry["goal"]: entry for entry in report}


def test_ratios_within_an_invocation_and_the_median_over_invocations(goals):
    # three invocations of the idealised MLP at S = 10: batched compiled at 6, 7 and 9 of generic's 10 steps/s
    documents = [
        _document([_row("mlp", "generic_compiled", 10, 10.0), _row("mlp", "batched_compiled", 10, v)]) for v in (6.0, 9.0, 7.0)
    ]
    entry = _by_goal(goals.evaluate(documents))["batched compiled / generic compiled, mlp S = 10"]
    assert entry["runs"] == pytest.approx([0.6, 0.9, 0.7])
    assert entry["median"] == pytest.approx(0.7) and entry["met"] is True  # 0.70 meets a goal of >= 0.70


def test_each_goal_reads_its_own_rows(goals):
    rows = [
        _row("mlp400", "bare", 200, 100.0), _row("mlp400", "batched_compiled", 200, 1500.0),
        _row("mlp400", "generic_compiled", 200, 2000.0), _row("mlp400", "one_batch_compiled", 200, 2000.0),
        _row("mlp_realistic", "bare", 50, 100.0),
        _row("mlp_realistic", "batched_compiled", 50, 790.0, stacked_fraction=1.0, padding_waste=0.3),
        _row("mlp_realistic", "sequential", 50, 96.0, stacked_fraction=0.0),
        _row("cnn_realistic", "bare", 20, 10.0), _row("cnn_realistic", "batched_compiled", 20, 25.0, stacked_fraction=0.9),
    ]  # fmt: skip
    report = _by_goal(goals.evaluate([_document(rows)]))
    assert report["batched compiled / generic compiled, mlp400 S = 200"]["median"] == pytest.approx(0.75)
    assert report["batched compiled / generic compiled, mlp400 S = 200"]["met"] is True
    assert report["batched compiled / one_batch compiled, mlp400 S = 200"]["met"] is False  # 0.75 < 0.80
    assert report["batched compiled x bare, mlp_realistic S = 50"]["median"] == pytest.approx(7.9)
    assert report["batched compiled x bare, mlp_realistic S = 50"]["met"] is False
    assert report["batched compiled x bare, cnn_realistic S = 20"]["met"] is True  # 2.5x
    assert report["rounds stacked, mlp_realistic S = 50 batched compiled"]["met"] is True
    assert report["rounds stacked, cnn_realistic S = 20 batched compiled"]["met"] is False  # 90 % of the rounds
    assert report["eager sequential x bare, mlp_realistic S = 50"]["median"] == pytest.approx(0.96)
    assert report["eager sequential x bare, mlp_realistic S = 50"]["met"] is True
    absent = report["sequential compiled x bare, mlp S = 10"]  # no such rows: not measured, with what measures it
    assert absent["median"] is None and absent["met"] is None and absent["runs"] == []
    assert "sequential_compiled" in absent["measure"]


def test_a_device_check_file_counts_each_step_as_an_invocation(goals):
    document = {
        "machine": {**MACHINE, "gpu": "Test GPU"},
        "steps": [
            {"name": "mlp_realistic_compiled", "rows": [_row("mlp_realistic", "bare", 50, 10.0), _row("mlp_realistic", "batched_compiled", 50, 90.0)]},
            {"name": "lora_round", "error": "timed out"},
            {"name": "again", "rows": [_row("mlp_realistic", "bare", 50, 10.0), _row("mlp_realistic", "batched_compiled", 50, 70.0)]},
        ],
    }  # fmt: skip
    assert len(goals.invocations(document)) == 2
    entry = _by_goal(goals.evaluate([document]))["batched compiled x bare, mlp_realistic S = 50"]
    assert entry["runs"] == pytest.approx([9.0, 7.0]) and entry["median"] == pytest.approx(8.0) and entry["met"] is True
    assert goals.machines([document]) == ["Test CPU, 2 cores, Test GPU, torch 2.13.0+cpu"]


def test_the_command_prints_the_table_and_refuses_files_without_rows(goals, tmp_path, capsys):
    good = tmp_path / "r.json"
    good.write_text(json.dumps(_document([_row("mlp", "bare", 10, 10.0), _row("mlp", "sequential", 10, 9.0)], steps_per_call=2)))
    assert goals.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "machine: Test CPU, 2 cores, torch 2.13.0+cpu; steps_per_call 2; 1 invocation(s)"
    assert "| eager sequential x bare, mlp S = 10 | 0.95 | 0.90 | 0.90 | no |" in out
    assert out.splitlines()[-1] == "0 of 1 measured goals met; 19 not measured"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(_document([])))
    assert goals.main([str(empty)]) == 2
    assert capsys.readouterr().err.strip() == f"goals: no benchmark rows in {empty} (files of benchmarks/run.py or device_check.sh)"
    assert goals.main([str(tmp_path / "missing.json")]) == 2
    capsys.readouterr()
    assert goals.main([str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"] == ["steps_per_call 2"]
