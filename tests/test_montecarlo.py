"""The Monte Carlo runner on the shipped least-squares configs (2 runs x 2 rounds)."""

import csv
from pathlib import Path

import numpy as np

from fl_lightning.experiments.montecarlo import main

ROOT = Path(__file__).resolve().parents[1]


def test_runner_writes_figures_table_and_per_round_statistics(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    results = main(
        [
            "--config", "configs/svrg_least_squares.yaml",
            "--runs", "2", "--set", "trainer.max_steps=2", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    (svrg,) = results["study"]
    assert svrg.cost.shape == (2, 3) and svrg.final.shape == (2, 5)
    assert abs(svrg.optimum - 0.004909344967018) < 1e-12, "f* of the shipped data (closed form: 0.004909344967018)"
    assert not np.allclose(svrg.cost[0], svrg.cost[1]), "runs differ in their activation and sample draws"
    assert (svrg.error > 0).all() and svrg.cost[0, 0] == svrg.cost[1, 0], "every run starts from theta0 = 0.5 * 1"
    summary = (tmp_path / "summary.md").read_text()
    assert "| study | svrg_least_squares | 2 | 2 |" in summary
    for name in ("cost_error_study.png", "variance_study.png", "cep_study.png"):
        assert (tmp_path / name).stat().st_size > 5000
    rows = list(csv.DictReader(open(tmp_path / "rounds.csv")))
    assert len(rows) == 3
    last = [r for r in rows if r["algorithm"] == "svrg_least_squares" and r["round"] == "2"][0]
    assert float(last["var_cost_error"]) == float(f"{svrg.error[:, -1].var(ddof=1):.6e}")
