"""Comparison plots: mean over seeds with a +-1 std band, each PNG next to the CSV of its data."""

from __future__ import annotations

import csv
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fl_lightning.history import ACC, BYTES, PER_CLIENT, ROUND, UPLOADS, History, seed_curve  # noqa: E402

LABELS = {
    ACC: "test accuracy",
    ROUND: "rounds",
    BYTES: "total communication (MB)",
    UPLOADS: "client uploads (total)",
    PER_CLIENT: "communication per client (model-sized messages)",
    "train/loss": "train loss (mean over active clients)",
    "train/consistency": "local consistency (1/S) Σ ||x_i - x̄||²",
    "val/loss": "test loss",
}
X_SCALE = {BYTES: 1e-6}  # bytes are plotted in MB
NOT_PLOTTED = ("comm/", "target/", "train/local_lr", "train/clients", ROUND, ACC)


@dataclass(frozen=True)
class Figure:
    name: str
    metric: str
    x: str = ROUND


def figures_for(histories: Mapping[str, Sequence[History]]) -> list[Figure]:
    """Accuracy against rounds and each communication measure, then every other logged metric against rounds."""
    logged = {m for hs in histories.values() for h in hs for m in h.metrics()}
    figures = [Figure("acc_vs_rounds", ACC)]
    for x, name in ((PER_CLIENT, "acc_vs_comm_per_client"), (UPLOADS, "acc_vs_client_uploads"), (BYTES, "acc_vs_bytes")):
        if x in logged:
            figures.append(Figure(name, ACC, x))
    for metric in sorted(logged):
        if not metric.startswith(NOT_PLOTTED):
            figures.append(Figure(re.sub(r"\W+", "_", metric).strip("_"), metric))
    return [f for f in figures if f.metric in logged]


def label(key: str) -> str:
    return LABELS.get(key, key)


def curves(histories: Mapping[str, Sequence[History]], figure: Figure) -> dict[str, dict[str, np.ndarray]]:
    out = {}
    for run, hs in histories.items():
        curve = seed_curve(hs, figure.metric, figure.x)
        if len(curve["round"]):
            curve["x"] = curve["x"] * X_SCALE.get(figure.x, 1.0)
            out[run] = curve
    return out


def draw(ax, data: Mapping[str, Mapping[str, np.ndarray]], figure: Figure) -> None:
    for run, curve in data.items():
        (line,) = ax.plot(curve["x"], curve["mean"], label=run, lw=1.5, marker="o" if len(curve["x"]) <= 30 else None, ms=3)
        ax.fill_between(curve["x"], curve["mean"] - curve["std"], curve["mean"] + curve["std"], color=line.get_color(), alpha=0.2, lw=0)
    ax.set_xlabel(label(figure.x))
    ax.set_ylabel(label(figure.metric))
    means = np.concatenate([np.asarray(c["mean"], dtype=float) for c in data.values()]) if data else np.array([])
    if means.size and (means > 0).all() and means.max() > 1e3 * means.min():  # e.g. gradient norms: span decades
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def write_csv(path: Path, data: Mapping[str, Mapping[str, np.ndarray]], figure: Figure) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        x_column = [] if figure.x == ROUND else [label(figure.x)]
        writer.writerow(["run", "round", *x_column, f"{figure.metric} mean", f"{figure.metric} std", "seeds"])
        for run, curve in data.items():
            for r, x, m, s, n in zip(curve["round"], curve["x"], curve["mean"], curve["std"], curve["n"]):
                xs = [] if figure.x == ROUND else [repr(float(x))]
                writer.writerow([run, f"{r:g}", *xs, repr(float(m)), repr(float(s)), int(n)])


def plot_all(histories: Mapping[str, Sequence[History]], out: Path, title: str = "") -> list[Path]:
    """One PNG + CSV per figure in ``out/plots``, and ``out/overview.png`` (accuracy, cost, loss, consistency)."""
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written, seeds = [], max(len(hs) for hs in histories.values())
    drawn: dict[str, tuple[Figure, dict]] = {}
    for figure in figures_for(histories):
        data = curves(histories, figure)
        if not data:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 4))
        draw(ax, data, figure)
        ax.set_title(f"{title} (mean ± std over {seeds} seeds)".strip(), fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plots / f"{figure.name}.png", dpi=110)
        plt.close(fig)
        write_csv(plots / f"{figure.name}.csv", data, figure)
        written += [plots / f"{figure.name}.png", plots / f"{figure.name}.csv"]
        drawn[figure.name] = (figure, data)

    panels = [n for n in ("acc_vs_rounds", "acc_vs_comm_per_client", "train_loss", "train_consistency") if n in drawn]
    if panels:
        cols = 2 if len(panels) > 2 else len(panels)
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.5 * rows), squeeze=False)
        for ax, name in zip(axes.flat, panels):
            draw(ax, drawn[name][1], drawn[name][0])
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{title} (mean ± std over {seeds} seeds)".strip(), fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "overview.png", dpi=100)
        plt.close(fig)
        written.append(out / "overview.png")
    return written
