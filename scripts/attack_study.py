"""The attack x defence study on digits (docs/robustness.md, "Study"): every attack of fl_lightning.adversary
against every defence, at 20 % malicious clients, on IID and Dirichlet(0.3) partitions, 3 seeds.

    python scripts/attack_study.py --out runs/attack_study \
        --defences none median trimmed_mean krum multi_krum bulyan geometric_median centered_clipping norm_bound fltrust

Each defence is ``none`` (the weighted mean) or a ``robust.rule`` (fl_lightning.robust), with optional
settings as JSON after a colon (``krum:{"f": 1}``; f defaults to 20 % of the reporting clients); it is set as
``--defence-setting`` (``model.robust`` by default). The script writes one ``compare`` sweep per
partition (``<out>/<partition>_sweep.yaml``, its runs in ``<out>/<partition>/``), runs it (``fl-lightning compare``), then writes
``<out>/table.md``/``table.csv`` (final test accuracy and backdoor success, mean ± std over seeds) and
``<out>/heatmap.png`` (attack x defence, one panel per partition and measure). ``--dry-run`` only writes the
sweeps; ``--report-only`` only reads finished runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from fl_lightning.experiments.sweep import dir_name

ROOT = Path(__file__).resolve().parent.parent
A = "fl_lightning.adversary."
BACKDOOR = {"class_path": A + "Backdoor", "init_args": {"target": 0, "fraction": 0.5, "patch": 2}}
ATTACKS: dict[str, dict] = {  # name -> attack.init_args besides fraction
    "none": {},
    "label flip": {"data": {"class_path": A + "LabelFlip"}},
    "backdoor": {"data": BACKDOOR},
    "backdoor + replacement": {"data": BACKDOOR, "upload": {"class_path": A + "ModelReplacement"}},
    "sign flip": {"upload": {"class_path": A + "SignFlip"}},
    "Gaussian": {"upload": {"class_path": A + "GaussianUpload", "init_args": {"std": 1.0}}},
    "ALIE": {"upload": {"class_path": A + "ALIE"}},
    "IPM": {"upload": {"class_path": A + "IPM", "init_args": {"epsilon": 0.1}}},
    "min-max": {"upload": {"class_path": A + "MinMax"}},
    "min-sum": {"upload": {"class_path": A + "MinSum"}},
}
PARTITIONS = {
    "iid": {"class_path": "fl_lightning.datamodules.IID"},
    "dirichlet0.3": {"class_path": "fl_lightning.datamodules.Dirichlet", "init_args": {"alpha": 0.3, "min_size": 10}},
}
FRACTION = 0.2


def defence_value(spec: str) -> tuple[str, dict | None]:
    """``(label, model.robust value)`` of a rule name (``fl_lightning.robust``'s ``robust.rule``) with optional
    settings as JSON after a colon (``krum:{"f": 1}``); f defaults to ``FRACTION`` of the reporting clients.
    ``none``: no defence (the weighted mean)."""
    rule, _, args = spec.partition(":")
    if rule == "none":
        return "none", None
    value: dict = {"rule": rule, **(json.loads(args) if args else {})}
    if "f" not in value:
        value.setdefault("fraction", FRACTION)
    return rule + (f" {args}" if args else ""), value


def sweep(partition: str, defences: list[tuple[str, dict | None]], setting: str, seeds: list[int], rounds: int) -> dict:
    runs = {}
    for attack, init in ATTACKS.items():
        fraction = 0.0 if attack == "none" else FRACTION
        attack_value = {"class_path": A + "Attack", "init_args": {"fraction": fraction, "data": None, "upload": None, **init}}
        if attack == "none":
            attack_value["init_args"]["upload"] = {"class_path": A + "SignFlip"}  # no malicious client: never applied
        for label, value in defences:
            run = {"model.attack": attack_value}
            if value is not None:
                run[setting] = value
            runs[f"{attack} | {label}"] = run
    return {
        "base": str(ROOT / "configs" / "attack_study_digits.yaml"),
        "seeds": seeds,
        "overrides": {"trainer.max_steps": rounds, "trainer.val_check_interval": min(rounds, 20), "trainer.enable_progress_bar": False, "data.init_args.partition": PARTITIONS[partition]},
        "runs": runs,
    }


def final(path: Path, metric: str) -> float:
    """The last logged value of ``metric`` in a run's metrics.csv (NaN if never logged)."""
    if not path.is_file():
        return math.nan
    with open(path) as f:
        values = [float(r[metric]) for r in csv.DictReader(f) if r.get(metric)]
    return values[-1] if values else math.nan


def cell(values: list[float]) -> str:
    values = [100 * v for v in values if not math.isnan(v)]
    if not values:
        return "–"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def report(out: Path, defences: list[str], seeds: list[int]) -> None:
    rows, means = [], {}
    for partition in PARTITIONS:
        for attack in ATTACKS:
            for defence in defences:
                run = out / partition / "runs" / dir_name(f"{attack} | {defence}")
                found = {m: [final(p / "metrics.csv", m) for p in sorted(run.glob("seed*"))] for m in ("test/acc", "attack/backdoor_asr")}
                rows.append([partition, attack, defence, cell(found["test/acc"]), cell(found["attack/backdoor_asr"])])
                for m, vs in found.items():
                    vs = [v for v in vs if not math.isnan(v)]
                    means[partition, m, attack, defence] = statistics.mean(vs) if vs else math.nan
    header = ["partition", "attack", "defence", "test accuracy (%)", "backdoor success (%)"]
    with open(out / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    (out / "table.md").write_text(f"Mean ± std over seeds {seeds}, final model, {int(FRACTION * 100)} % malicious clients.\n\n" + "\n".join(lines) + "\n")
    heatmap(out / "heatmap.png", means, defences)


def heatmap(path: Path, means: dict, defences: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [(p, m) for p in PARTITIONS for m in ("test/acc", "attack/backdoor_asr")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + (2.5 + 0.6 * len(defences)) * len(panels), 5), squeeze=False)
    for ax, (partition, metric) in zip(axes[0], panels):
        grid = np.array([[100 * means[partition, metric, a, d] for d in defences] for a in ATTACKS])
        image = ax.imshow(grid, cmap="viridis" if metric == "test/acc" else "magma", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(defences)), defences, rotation=45, ha="right")
        ax.set_yticks(range(len(ATTACKS)), list(ATTACKS))
        for (i, j), v in np.ndenumerate(grid):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="k" if v > 60 else "w", fontsize=7)
        ax.set_title(f"{partition}: {'test accuracy' if metric == 'test/acc' else 'backdoor success'} (%)")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--defences", nargs="+", default=["none"])
    parser.add_argument("--defence-setting", default="model.robust")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    defences = [defence_value(spec) for spec in args.defences]
    if not args.report_only:
        for partition in PARTITIONS:
            folder = args.out / partition
            folder.mkdir(parents=True, exist_ok=True)
            config = args.out / f"{partition}_sweep.yaml"
            config.write_text(yaml.safe_dump(sweep(partition, defences, args.defence_setting, args.seeds, args.rounds), sort_keys=False))
            if not args.dry_run:
                command = [str(Path(sys.executable).with_name("fl-lightning")), "compare", "--config", str(config), "--out", str(folder), "--allow-failures"]
                subprocess.run(command, check=True)
    if not args.dry_run:
        report(args.out, [label for label, _ in defences], args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
