"""Comparison plots stay readable: identical curves remain visible, bands stay in the metric's
range, labels are words, and metrics that are zero everywhere get no figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from fl_lightning.experiments.history import ACC, History
from fl_lightning.experiments.plots import Figure, curves, draw, label, plot_all, style


def history(acc_offset: float = 0.0, loss_offset: float = 0.0) -> History:
    records = []
    for r in range(1, 7):
        records.append({"round": float(r), ACC: min(0.98, 0.5 + 0.1 * r) + acc_offset,
                        "train/loss": 0.05 + loss_offset, "faults/dropped": 0.0})  # fmt: skip
    return History(records)


def test_identical_runs_get_distinct_colour_line_style_and_marker():
    same = {"FedAvg": [history()], "FedProx mu=0.01": [history()]}
    fig, ax = plt.subplots()
    data = curves(same, Figure("acc_vs_rounds", ACC))
    draw(ax, data, Figure("acc_vs_rounds", ACC), {run: style(i) for i, run in enumerate(same)})
    a, b = ax.lines
    plt.close(fig)
    assert np.array_equal(a.get_ydata(), b.get_ydata())
    assert a.get_color() != b.get_color()
    assert a.get_linestyle() != b.get_linestyle() and a.get_marker() != b.get_marker()


def _band_extent(histories, metric: str) -> tuple[float, float]:
    fig, ax = plt.subplots()
    figure = Figure("f", metric)
    draw(ax, curves(histories, figure), figure, {run: style(i) for i, run in enumerate(histories)})
    ys = np.concatenate([p.vertices[:, 1] for c in ax.collections for p in c.get_paths()])
    plt.close(fig)
    return float(ys.min()), float(ys.max())


def test_std_bands_are_clipped_to_the_metric_range():
    # seeds 0.05 and 1.05 apart: mean ± std would reach below 0 (loss) and above 1 (accuracy)
    spread = {"run": [history(loss_offset=0.0, acc_offset=-0.3), history(loss_offset=1.0, acc_offset=0.02)]}
    low, _ = _band_extent(spread, "train/loss")
    assert low >= 0.0
    low, high = _band_extent(spread, ACC)
    assert high <= 1.0 and low >= 0.0


def test_labels_are_words_not_raw_keys():
    for key in ("clients/acc_worst10", "faults/dropped", "val/acc", "train/server_lr", "algo/c_norm"):
        text = label(key)
        assert "/" not in text and "_" not in text, text
    assert label("clients/acc_worst10") == "per-client accuracy, worst 10% of clients"


def test_metrics_zero_everywhere_get_no_plot(tmp_path):
    written = plot_all({"A": [history()], "B": [history(0.01)]}, tmp_path, "t")
    names = {p.name for p in written}
    assert "acc_vs_rounds.png" in names and "train_loss.png" in names
    assert not any(n.startswith("faults_") for n in names)
    assert (tmp_path / "overview.png").is_file()


def test_failed_runs_are_named_in_the_legend(tmp_path):
    histories = {"ok": [history(), history(0.01)], "lr=1": [history(), History()]}
    statuses = {"ok": [None, None], "lr=1": [None, "diverged at round 3"]}
    from fl_lightning.experiments.plots import _plotted

    plotted, labels = _plotted(histories, statuses)
    assert labels["lr=1"] == "lr=1 (1/2 seeds; diverged at round 3)" and labels["ok"] == "ok"
    assert len(plotted["lr=1"]) == 1  # the finished seed only
    plot_all(histories, tmp_path, "t", statuses=statuses)
    assert (tmp_path / "plots" / "acc_vs_rounds.png").stat().st_size > 1000


def test_per_client_accuracy_distribution_plot(tmp_path):
    import csv

    from fl_lightning.experiments.plots import plot_per_client

    written = plot_per_client({"A": [1.0, 0.5, 0.0, 0.75], "B": [], "C": [0.9] * 10}, tmp_path, "t", {"A": 60.0, "C": 60.0})
    assert [p.name for p in written] == ["per_client_acc.png", "per_client_acc.csv"]
    with open(tmp_path / "plots" / "per_client_acc.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"A", "C"}  # a run without per-client data is left out
    assert float(rows["A"]["mean"]) == 0.5625 and float(rows["A"]["worst10"]) == 0.0 and rows["A"]["clients"] == "4"
    assert plot_per_client({"A": []}, tmp_path) == []
