"""Comparison plots: mean over seeds with a +-1 std band, each PNG next to the CSV of its data.

Every run has its own colour *and* line style and marker, so identical curves (FedAvg and
FedProx with a tiny mu) stay visible; bands are clipped to the metric's range (accuracy in
[0, 1], losses and norms >= 0); axes carry human labels; a metric that is zero everywhere
(e.g. fault counters when faults are off) gets no figure. A run whose seeds failed or diverged
is drawn from its finished seeds, its legend entry saying what happened.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fl_lightning.experiments.history import ACC, BYTES, PER_CLIENT, ROUND, SIM_TIME, TEST_ACC, UPLOADS, History, seed_curve  # noqa: E402
from fl_lightning.experiments.labels import BELOW, measured  # noqa: E402

LABELS = {
    ACC: "validation accuracy",  # the test set when the data has no validation split (data.val_fraction)
    "test/acc": "test accuracy",
    "test/loss": "test loss",
    "train/acc": "train accuracy",
    "train/local_lr": "local learning rate",
    "train/global_cost": "global cost f(θ)",
    "train/cost_error": "f(θ) − f*",
    "time/round_s": "wall time per round (s)",
    SIM_TIME: "simulated time (s)",
    "algo/c_norm": "server control variate ‖c‖",
    ROUND: "round",
    BYTES: "total communication (MB)",
    UPLOADS: "client uploads (total)",
    "privacy/epsilon": "privacy loss epsilon (worst client)",
    PER_CLIENT: "communication per client (model-sized messages)",
    "train/loss": "train loss (mean over active clients)",
    "train/consistency": "local consistency (1/S) Σ ||x_i - x̄||²",
    "train/server_lr": "server learning rate",
    "val/loss": "validation loss",
    "val/personal_acc_mean": "personalized accuracy (client holdout, validation half), mean over clients",
    "val/personal_acc_weighted": "personalized accuracy (client holdout, validation half), weighted by size",
    "val/personal_acc_worst10": "personalized accuracy (client holdout, validation half), worst 10% of clients",
    "val/personal_acc_best10": "personalized accuracy (client holdout, validation half), best 10% of clients",
    "val/personal_acc_var": "variance of personalized accuracy across clients (client holdout, validation half)",
    "val/personal_loss_mean": "personalized loss (client holdout), mean over clients",
    "val/unseen_acc_mean": "unseen-client accuracy after personalization, mean",
    "val/unseen_acc_weighted": "unseen-client accuracy after personalization, weighted",
    "val/unseen_acc_worst10": "unseen-client accuracy after personalization, worst 10%",
    "val/unseen_loss_mean": "unseen-client loss after personalization, mean",
    "clients/acc_mean": "per-client accuracy, mean over clients",
    "clients/acc_worst10": "per-client accuracy, worst 10% of clients",
    "clients/acc_std": "per-client accuracy, std over clients",
    "faults/dropped": "clients dropped per round",
    "faults/failed": "clients failed per round",
    "faults/stragglers": "stragglers per round",
    "robust/kept_fraction": "share of reporting clients the robust rule kept",
    "robust/upload_norm_mean": "upload norm ‖u_i‖, mean over reporting clients",
    "robust/norm_benign": "upload norm ‖u_i‖, mean over benign clients",
    "robust/norm_malicious": "upload norm ‖u_i‖, mean over malicious clients",
    "robust/skipped": "round skipped: too few clients for the robust rule",
}
SHORT_LABELS = {  # the overview's panels are small
    "train/consistency": "local consistency",
    "train/loss": "train loss",
    PER_CLIENT: "comm. per client (messages)",
}
X_SCALE = {BYTES: 1e-6}  # bytes are plotted in MB
EPSILON = "privacy/epsilon"  # client-level DP's spent budget (docs/privacy.md): the privacy-utility curve
NOT_PLOTTED = ("comm/", "target/", "train/local_lr", "train/clients", ROUND, ACC)
COLORS = plt.get_cmap("tab10").colors
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


@dataclass(frozen=True)
class Figure:
    name: str
    metric: str
    x: str = ROUND


def figures_for(histories: Mapping[str, Sequence[History]]) -> list[Figure]:
    """Accuracy against rounds and each communication measure, then every other logged metric against rounds."""
    logged = {m for hs in histories.values() for h in hs for m in h.metrics()}
    figures = [Figure("acc_vs_rounds", ACC)]
    for x, name in ((PER_CLIENT, "acc_vs_comm_per_client"), (UPLOADS, "acc_vs_client_uploads"), (BYTES, "acc_vs_bytes"), (EPSILON, "acc_vs_epsilon"),
                    (SIM_TIME, "acc_vs_sim_time")):
        if x in logged:
            figures.append(Figure(name, ACC, x))
    for metric in sorted(logged):
        if not metric.startswith(NOT_PLOTTED):
            figures.append(Figure(re.sub(r"\W+", "_", metric).strip("_"), metric))
    return [f for f in figures if f.metric in logged]


def label(key: str, short: bool = False) -> str:
    """A human label for a logged key: the table above, else ``algo/h_norm`` -> ``‖h‖``, ``time/x_s`` -> ``x (s)``."""
    if short and key in SHORT_LABELS:
        return SHORT_LABELS[key]
    if key in LABELS:
        return LABELS[key]
    if BELOW.fullmatch(key):  # the share of clients below an accuracy threshold
        quantity = measured(key).quantity
        return quantity[0].lower() + quantity[1:]
    name = key.split("/", 1)[-1]
    name = re.sub(r"^(.+)_norm$", r"‖\1‖", name)  # algo/h_norm -> ‖h‖
    name = re.sub(r"_s$", " (s)", name)  # seconds
    name = name.replace("_", " ")
    name = re.sub(r"\bacc\b", "accuracy", name)
    name = re.sub(r"\blr\b", "learning rate", name)
    return name


def value_range(metric: str) -> tuple[float, float]:
    """The range a metric's values (and so its band) lie in."""
    leaf = metric.split("/")[-1]
    if re.search(r"(^|_)acc(uracy)?(_|$)", leaf) and not leaf.endswith("_std"):
        return 0.0, 1.0
    if leaf in ("kept_fraction", "skipped"):
        return 0.0, 1.0
    if re.search(r"loss|consistency|norm|lr|bytes|time|std|dropped|failed|stragglers|clients", leaf):
        return 0.0, math.inf
    return -math.inf, math.inf


def curves(histories: Mapping[str, Sequence[History]], figure: Figure) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for run, hs in histories.items():
        hs = [h for h in hs if h.records]
        if not hs:
            continue
        curve = seed_curve(hs, figure.metric, figure.x)
        if len(curve["round"]):
            curve["x"] = curve["x"] * X_SCALE.get(figure.x, 1.0)
            out[run] = curve
    return out


def style(index: int) -> dict:
    """The index-th run's colour, line style and marker (distinct for the first 10 runs in colour,
    and in (line style, marker) for the first 8)."""
    return {
        "color": COLORS[index % len(COLORS)],
        "linestyle": LINESTYLES[index % len(LINESTYLES)],
        "marker": MARKERS[index % len(MARKERS)],
        "lw": max(1.1, 2.6 - 0.4 * index),  # earlier runs drawn wider: a later identical curve leaves them visible
        "index": index,  # markers of different runs sit on different points
    }


def axis_names(histories: Mapping[str, Sequence[History]]) -> dict[str, str]:
    """Axis labels that depend on the data: without a validation split (no ``test/acc`` logged)
    ``val/acc`` is the test set's accuracy."""
    split = any(TEST_ACC in r for hs in histories.values() for h in hs for r in h.records)
    return {} if split else {ACC: "test accuracy (no validation split)"}


def draw(ax, data: Mapping[str, Mapping[str, np.ndarray]], figure: Figure, styles: Mapping[str, dict],
         labels: Mapping[str, str] | None = None, short: bool = False, names: Mapping[str, str] | None = None) -> None:  # fmt: skip
    low, high = value_range(figure.metric)
    same = coinciding(data)
    for run, curve in data.items():
        st = styles[run]
        every = max(1, len(curve["x"]) // 10)
        name = (labels or {}).get(run, run)
        if run in same:  # drawn under the earlier run's identical curve: the legend says so
            name = f"{name} (= {(labels or {}).get(same[run], same[run])})"
        ax.plot(curve["x"], curve["mean"], label=name, lw=st["lw"], ms=4.5,
                markevery=(st["index"] % every, every), color=st["color"], linestyle=st["linestyle"],
                marker=st["marker"])  # fmt: skip
        lower = np.clip(curve["mean"] - curve["std"], low, high)
        upper = np.clip(curve["mean"] + curve["std"], low, high)
        ax.fill_between(curve["x"], lower, upper, color=st["color"], alpha=0.15, lw=0)
    ax.set_xlabel((names or {}).get(figure.x) or label(figure.x, short))
    ax.set_ylabel((names or {}).get(figure.metric) or label(figure.metric, short))
    means = np.concatenate([np.asarray(c["mean"], dtype=float) for c in data.values()]) if data else np.array([])
    if means.size and (means > 0).all() and means.max() > 1e3 * means.min():  # e.g. gradient norms: span decades
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def coinciding(data: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, str]:
    """``{run: earlier run}`` for runs whose curve (x, mean and std) equals an earlier run's exactly."""
    out: dict[str, str] = {}
    runs = list(data)
    for i, run in enumerate(runs):
        for earlier in runs[:i]:
            a, b = data[run], data[earlier]
            if earlier not in out and all(
                np.array_equal(np.asarray(a[k], dtype=float), np.asarray(b[k], dtype=float), equal_nan=True) for k in ("x", "mean", "std")
            ):
                out[run] = earlier
                break
    return out


def all_zero(data: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
    return all(np.all(np.asarray(c["mean"]) == 0) and np.all(np.asarray(c["std"]) == 0) for c in data.values())


def write_csv(path: Path, data: Mapping[str, Mapping[str, np.ndarray]], figure: Figure) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        x_column = [] if figure.x == ROUND else [label(figure.x)]
        writer.writerow(["run", "round", *x_column, f"{figure.metric} mean", f"{figure.metric} std", "seeds"])
        for run, curve in data.items():
            for r, x, m, s, n in zip(curve["round"], curve["x"], curve["mean"], curve["std"], curve["n"]):
                xs = [] if figure.x == ROUND else [repr(float(x))]
                writer.writerow([run, f"{r:g}", *xs, repr(float(m)), repr(float(s)), int(n)])


def _plotted(histories: Mapping[str, Sequence[History]], statuses: Mapping[str, Sequence[str | None]] | None):
    """The histories to draw (finished seeds; a run none of whose seeds finished: its partial logs)
    and each run's legend label."""
    plotted, labels = {}, {}
    for run, hs in histories.items():
        status = list((statuses or {}).get(run) or [None] * len(hs))
        ok = [h for h, s in zip(hs, status) if s is None]
        failures = [s for s in status if s]
        plotted[run] = ok or [h for h in hs if h.records]
        if not failures:
            labels[run] = run
        elif ok:
            labels[run] = f"{run} ({len(ok)}/{len(hs)} seeds; {failures[0]})"
        else:
            labels[run] = f"{run} ({failures[0]})"
    return plotted, labels


OVERVIEW = ("acc_vs_rounds", "val_personal_acc_mean", "acc_vs_comm_per_client", "train_loss", "train_consistency")
"""The overview's panels where drawn: a personalized run's own measure (the model each client predicts with) sits
beside the global model's accuracy, which alone reads as a failure for methods whose global model is partial."""


def overview_panels(drawn: Mapping[str, Any]) -> list[str]:
    return [name for name in OVERVIEW if name in drawn]


def plot_all(
    histories: Mapping[str, Sequence[History]],
    out: Path,
    title: str = "",
    statuses: Mapping[str, Sequence[str | None]] | None = None,
) -> list[Path]:
    """One PNG + CSV per figure in ``out/plots``, and ``out/overview.png`` (accuracy, personalized accuracy where
    logged, cost, loss, consistency)."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    seeds = max(len(hs) for hs in histories.values())
    histories, labels = _plotted(histories, statuses)
    names = axis_names(histories)
    styles = {run: style(i) for i, run in enumerate(histories)}
    written: list[Path] = []
    drawn: dict[str, tuple[Figure, dict]] = {}
    for figure in figures_for(histories):
        data = curves(histories, figure)
        if not data or all_zero(data):
            continue
        fig, ax = plt.subplots(figsize=(6, 4.2), layout="constrained")
        draw(ax, data, figure, styles, labels, names=names)
        ax.set_title(f"{title} (mean ± std over {seeds} seeds)".strip(), fontsize=9)
        ax.legend(fontsize=8)
        fig.savefig(plots / f"{figure.name}.png", dpi=110)
        plt.close(fig)
        write_csv(plots / f"{figure.name}.csv", data, figure)
        written += [plots / f"{figure.name}.png", plots / f"{figure.name}.csv"]
        drawn[figure.name] = (figure, data)

    panels = overview_panels(drawn)
    if panels:
        cols = 2 if len(panels) > 2 else len(panels)
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False, layout="constrained")
        for ax, name in zip(axes.flat, panels):
            draw(ax, drawn[name][1], drawn[name][0], styles, labels, short=True, names=names)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{title} (mean ± std over {seeds} seeds)".strip(), fontsize=10)
        fig.savefig(out / "overview.png", dpi=100)
        plt.close(fig)
        written.append(out / "overview.png")
    return written


def _boxes(path: Path, values: Mapping[str, Sequence[float]], styles: Mapping[str, dict], ylabel: str, title: str) -> None:
    """A box per run (no fliers) with every value as a jittered dot."""
    runs = list(values)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * len(runs) + 2), 4.2), layout="constrained")
    ax.boxplot([values[run] for run in runs], showfliers=False, widths=0.5)
    rng = np.random.default_rng(0)
    for i, run in enumerate(runs, start=1):
        points = np.asarray(values[run], dtype=float)
        ax.scatter(i + rng.uniform(-0.15, 0.15, len(points)), points, s=10, alpha=0.6,
                   color=styles[run]["color"], marker=styles[run]["marker"])  # fmt: skip
    ax.set_xticks(range(1, len(runs) + 1), runs, rotation=20 if len(runs) > 3 else 0)
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_client(
    accuracies: Mapping[str, Sequence[float]], out: Path, title: str = "", rounds: Mapping[str, float] | None = None
) -> list[Path]:
    """``plots/per_client_acc.png`` + ``.csv``: the distribution over clients (pooled over seeds) of
    each run's accuracy on the clients' held-out data at its last evaluation (a box per run with
    every client as a dot), from ``PerClientEvaluation``'s ``per_client_acc.csv``."""
    runs = [run for run, values in accuracies.items() if len(values)]
    if not runs:
        return []
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    styles = {run: style(i) for i, run in enumerate(accuracies)}
    _boxes(plots / "per_client_acc.png", {run: accuracies[run] for run in runs}, styles, "accuracy on the client's held-out data",
           f"{title}: per-client accuracy at the last evaluation (clients of all seeds)".strip(": "))  # fmt: skip
    with open(plots / "per_client_acc.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "round", "clients", "mean", "median", "worst10", "min", "max"])
        for run in runs:
            values = np.sort(np.asarray(accuracies[run], dtype=float))
            worst = values[: max(1, math.ceil(0.1 * len(values)))].mean()
            writer.writerow([run, f"{(rounds or {}).get(run, float('nan')):g}", len(values), repr(float(values.mean())),
                             repr(float(np.median(values))), repr(float(worst)), repr(float(values[0])), repr(float(values[-1]))])  # fmt: skip
    return [plots / "per_client_acc.png", plots / "per_client_acc.csv"]


CLIENTS_ACC = "clients_test_acc"
"""``plots/clients_test_acc.png``: each run's per-client test accuracy at the final evaluation (``clients.csv``)."""


def plot_client_records(
    records: Mapping[str, Sequence[Mapping[str, Any]]], out: Path, title: str = "", pair: tuple[str, str] | None = None
) -> list[Path]:
    """From the runs' ``clients.csv`` (``compare.load_client_records``: each training client's row of each seed's final
    test evaluation), the accuracy of the model each client predicts with on the test half of its held-out data:

    - ``plots/clients_test_acc.png`` + ``.csv``: a box per run over its clients, seeds pooled, every client a dot;
    - ``plots/clients_scatter_<A>_vs_<B>.png`` + ``.csv``: run B's accuracy against run A's, one dot per client and
      seed (the same client of the same seed: the same data), for ``pair`` or else the first run against each other.
    """
    runs = [run for run, rows in records.items() if rows]
    if not runs:
        return []
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    styles = {run: style(i) for i, run in enumerate(records)}
    seeds = sorted({r["seed"] for run in runs for r in records[run]})
    _boxes(plots / f"{CLIENTS_ACC}.png", {run: [r["personal_acc"] for r in records[run]] for run in runs}, styles,
           "test accuracy of the model the client predicts with",
           f"{title}\neach client's test accuracy, final model (seeds {seeds} pooled)".strip())  # fmt: skip
    with open(plots / f"{CLIENTS_ACC}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "seed", "client", "round", "samples", "global_acc", "personal_acc"])
        for run in runs:
            writer.writerows([run, r["seed"], r["client"], r["round"], r["samples"], repr(r["global_acc"]), repr(r["personal_acc"])]
                             for r in records[run])  # fmt: skip
    written = [plots / f"{CLIENTS_ACC}.png", plots / f"{CLIENTS_ACC}.csv"]
    pairs = [pair] if pair is not None else [(runs[0], other) for other in runs[1:]]
    for a, b in pairs:
        if a in runs and b in runs:
            written += _client_scatter(plots, records[a], records[b], a, b, styles[b], title)
    return written


def _client_scatter(plots: Path, rows_a, rows_b, a: str, b: str, st: dict, title: str) -> list[Path]:
    """Run ``b``'s per-client test accuracy against run ``a``'s, paired by (seed, client), with the diagonal."""
    of_a = {(r["seed"], r["client"]): r["personal_acc"] for r in rows_a}
    paired = [(key, of_a[key], r["personal_acc"]) for r in rows_b if (key := (r["seed"], r["client"])) in of_a]
    if not paired:
        return []
    name = f"clients_scatter_{re.sub(r'[^A-Za-z0-9.=+-]+', '_', a).strip('_')}_vs_{re.sub(r'[^A-Za-z0-9.=+-]+', '_', b).strip('_')}"
    xs, ys = np.array([p[1] for p in paired]), np.array([p[2] for p in paired])
    fig, ax = plt.subplots(figsize=(4.6, 4.4), layout="constrained")
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, linestyle="--")
    ax.scatter(xs, ys, s=14, alpha=0.7, color=st["color"], marker=st["marker"])
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_aspect("equal")
    ax.set_xlabel(f"{a}: client's test accuracy")
    ax.set_ylabel(f"{b}: client's test accuracy")
    above, below = int((ys > xs).sum()), int((ys < xs).sum())
    ax.set_title(f"{title}\none dot per client and seed; {b} better for {above}, worse for {below}".strip(), fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(plots / f"{name}.png", dpi=110)
    plt.close(fig)
    with open(plots / f"{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["seed", "client", f"{a} personal_acc", f"{b} personal_acc"])
        writer.writerows([seed, client, repr(float(x)), repr(float(y))] for (seed, client), x, y in paired)
    return [plots / f"{name}.png", plots / f"{name}.csv"]
