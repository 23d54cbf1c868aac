"""The compression study's figure: validation accuracy (val/acc) against total bytes (log scale), FedAvg and SCAFFOLD
side by side, from the ``acc_vs_bytes.csv`` that ``fl-lightning compare`` writes (docs/compression.md).

    python scripts/compression_figure.py runs/compression_digits/plots/acc_vs_bytes.csv docs/figures/compression_digits_acc_vs_bytes.png
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(source: str, target: str) -> None:
    curves: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with open(source) as f:
        for row in csv.DictReader(f):
            curves[row["run"]].append((float(row["total communication (MB)"]), float(row["val/acc mean"])))
    algorithms = sorted({run.split(" ", 1)[0] for run in curves}, key=lambda a: a != "FedAvg")
    settings = list(dict.fromkeys(run.split(" ", 1)[1] for run in curves))
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(algorithms), figsize=(6 * len(algorithms), 4.5), sharey=True)
    for ax, algorithm in zip(axes, algorithms):
        for i, setting in enumerate(settings):
            points = curves.get(f"{algorithm} {setting}")
            if points:
                ax.plot(*zip(*points), color=colors[i % 10], linestyle="-" if i < 10 else "--", marker=".", label=setting)
        ax.set_xscale("log")
        ax.set_title(algorithm)
        ax.set_xlabel("total communication, up + down (MB, log scale)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("validation accuracy")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(target, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
