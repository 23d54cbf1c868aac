"""``fl-lightning partition --config CONFIG --out FILE.png [--<key> VALUE ...]``: the label
distribution of every client of a fit config's partition (one stacked bar per client, one colour
per class), and ``FILE.csv`` with the counts (rows: clients, columns: classes).

Any further ``--<dotted key> value`` is a fit setting (e.g. ``--seed_everything 1`` or
``--data.init_args.partition.init_args.alpha 0.1``), so the picture is of exactly the split a
``fit`` with the same arguments trains on.
"""

from __future__ import annotations

import argparse
import textwrap
import csv
from pathlib import Path

import numpy as np


def label_counts(datamodule) -> np.ndarray:
    """``counts[client, class]``: the samples of each class a client holds (training + held out + validation)."""
    datamodule.setup("fit")
    labels = np.asarray(datamodule.source.train_labels)
    num_classes = int(datamodule.num_classes)
    counts = np.zeros((datamodule.num_clients, num_classes), dtype=np.int64)
    parts = datamodule.partition(datamodule.source.train_labels, datamodule.num_clients, datamodule.seed)
    for cid, idx in enumerate(parts):  # the whole share: training, held-out and validation samples
        counts[cid] = np.bincount(labels[np.asarray(idx)].astype(np.int64), minlength=num_classes)[:num_classes]
    return counts


def class_names(datamodule, classes: int) -> list[str]:
    """The classes' names where the data names them (``categories``, e.g. Dolly's tasks), else ``class c``."""
    names = list(getattr(datamodule, "categories", None) or [])
    return names if len(names) == classes else [f"class {c}" for c in range(classes)]


def draw(counts: np.ndarray, path: Path, title: str = "", names: list[str] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    clients, classes = counts.shape
    cmap = plt.get_cmap("tab10" if classes <= 10 else "tab20" if classes <= 20 else "viridis")
    colors = [cmap(c % cmap.N) if classes <= 20 else cmap(c / max(1, classes - 1)) for c in range(classes)]
    fig, ax = plt.subplots(figsize=(min(18, max(6, 0.3 * clients + 2)), 4.2), layout="constrained")
    bottom = np.zeros(clients)
    for c in range(classes):
        ax.bar(np.arange(clients), counts[:, c], bottom=bottom, color=colors[c], width=0.85,
               label=(names[c] if names else f"class {c}") if classes <= 20 else None)  # fmt: skip
        bottom += counts[:, c]
    ax.set_xlabel("client")
    ax.set_ylabel("samples")
    ax.set_xlim(-0.6, clients - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if classes <= 20:
        ax.legend(fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title("\n".join(textwrap.wrap(title, 60)), fontsize=9)  # a long title would be cut at the figure's edge
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fl-lightning partition",
        description="Draw the label distribution of every client of a fit config's partition.",
        epilog="Further --<key> VALUE arguments are fit settings, e.g. --seed_everything 1.",
    )
    parser.add_argument("--config", required=True, help="a fit config (YAML)")
    parser.add_argument("--out", required=True, help="the PNG to write (the counts go to the same name with .csv)")
    ns, rest = parser.parse_known_args(argv)
    out = Path(ns.out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"partition --out must be a .png file, got {ns.out!r}")

    from fl_lightning.run.cli_app import build as build_cli

    cli = build_cli(["--config", ns.config, "--trainer.logger", "false", *rest], run=False)
    data = cli.datamodule
    counts = label_counts(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    partition = type(data.partition).__name__
    args = ", ".join(f"{k}={v}" for k, v in vars(data.partition).items() if not k.startswith("_"))
    title = f"{Path(ns.config).stem}: {partition}({args}), {data.num_clients} clients, seed {data.seed}"
    names = class_names(data, counts.shape[1])
    draw(counts, out, title, names)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["client", *names, "total"])
        for cid, row in enumerate(counts):
            writer.writerow([cid, *row.tolist(), int(row.sum())])
    print(f"wrote {out} and {out.with_suffix('.csv')} ({counts.shape[0]} clients, {counts.shape[1]} classes)")
