"""compare's plots: coinciding curves are named in the legend, axis labels are words with units."""

from __future__ import annotations

import numpy as np

from fl_lightning.experiments.plots import Figure, coinciding, draw, label, plt, style


def _curve(mean):
    mean = np.asarray(mean, dtype=float)
    return {"round": np.arange(len(mean)), "x": np.arange(len(mean), dtype=float), "mean": mean, "std": np.zeros_like(mean)}


def test_a_curve_equal_to_an_earlier_one_says_so_in_the_legend():
    data = {"FedAvg": _curve([0.1, 0.5, 0.8]), "FedProx mu=0.01": _curve([0.1, 0.5, 0.8]), "K=1": _curve([0.1, 0.4, 0.6])}
    assert coinciding(data) == {"FedProx mu=0.01": "FedAvg"}
    fig, ax = plt.subplots()
    draw(ax, data, Figure("acc", "val/acc"), {run: style(i) for i, run in enumerate(data)})
    assert [line.get_label() for line in ax.get_lines()] == ["FedAvg", "FedProx mu=0.01 (= FedAvg)", "K=1"]
    widths = [line.get_linewidth() for line in ax.get_lines()]
    assert widths[0] > widths[1]  # the earlier curve is drawn wider: it shows around the later one
    plt.close(fig)


def test_raw_metric_names_become_labels_with_units():
    assert label("algo/c_norm") == "server control variate ‖c‖"
    assert label("time/round_s") == "wall time per round (s)"
    assert label("algo/h_norm") == "‖h‖" and label("time/eval_s") == "eval (s)"
    assert label("val/acc") == "validation accuracy" and label("test/acc") == "test accuracy"


def test_val_acc_is_labelled_test_accuracy_when_there_is_no_validation_split():
    from fl_lightning.experiments.history import History
    from fl_lightning.experiments.plots import axis_names

    no_split = {"A": [History([{"round": 5.0, "val/acc": 0.5}])]}
    split = {"A": [History([{"round": 5.0, "val/acc": 0.5, "test/acc": 0.4}])]}
    assert axis_names(split) == {}
    names = axis_names(no_split)
    assert names == {"val/acc": "test accuracy (no validation split)"}
    fig, ax = plt.subplots()
    draw(ax, {"A": _curve([0.1, 0.5])}, Figure("acc_vs_rounds", "val/acc"), {"A": style(0)}, names=names)
    assert ax.get_ylabel() == "test accuracy (no validation split)"
    plt.close(fig)
