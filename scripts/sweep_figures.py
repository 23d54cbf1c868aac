"""Run a sweep (the shared sweep format, see configs/*_sweep.yaml) and plot one metric against rounds.

A stand-in for ``fl-lightning compare`` limited to what the personalization figures need:
every run x seed is an ordinary ``fl-lightning fit`` subprocess (``--jobs`` at a time), logged
with a CSVLogger to ``OUT/runs/<run>/seed<s>/metrics.csv``; then ``OUT/<metric>.png`` and
``OUT/<metric>.csv`` hold the metric (mean over seeds) against rounds, and ``OUT/summary.md``
its mean over the last ``--tail`` evaluations (the steady state).

    python scripts/sweep_figures.py --config configs/personalization_K_sweep.yaml --out runs/pers_K
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _value(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)


def fit_args(sweep: dict, name: str, seed: int, out: Path) -> list[str]:
    args = ["fit", "--config", str(ROOT / sweep["base"]), "--seed_everything", str(seed), "--data.init_args.seed", str(seed)]
    for key, value in {**sweep.get("overrides", {}), **(sweep["runs"][name] or {})}.items():
        args += [f"--{key}", _value(value)]
    args += [
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(out / "runs"),
        "--trainer.logger.init_args.name", re.sub(r"\W+", "_", name),
        "--trainer.logger.init_args.version", f"seed{seed}",
    ]  # fmt: skip
    return args


def run(sweep: dict, name: str, seed: int, out: Path) -> Path:
    log_dir = out / "runs" / re.sub(r"\W+", "_", name) / f"seed{seed}"
    if (log_dir / "done").is_file():
        return log_dir
    exe = Path(sys.executable).with_name("fl-lightning")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(exe), *fit_args(sweep, name, seed, out)], cwd=out, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    (log_dir / "done").write_text("ok")
    print(f"done: {name} seed {seed}", flush=True)
    return log_dir


def curve(log_dir: Path, metric: str) -> list[tuple[int, float]]:
    with open(log_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get(metric)]
    return [(int(r["step"]) + 1, float(r[metric])) for r in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--metric", default="algo/grad_norm_sq")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tail", type=int, default=5, help="evaluations averaged for the steady state")
    args = parser.parse_args(argv)
    sweep = yaml.safe_load(Path(args.config).read_text())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, seed) for name in sweep["runs"] for seed in sweep.get("seeds", [0])]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = dict(zip(jobs, pool.map(lambda job: run(sweep, *job, out), jobs)))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    stem = re.sub(r"\W+", "_", args.metric)
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = ["| run | steady state (mean of last %d evals, mean over seeds) |" % args.tail, "|---|---|"]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "round", f"{args.metric} mean", "seeds"])
        for name in sweep["runs"]:
            curves = [curve(dirs[(name, s)], args.metric) for s in sweep.get("seeds", [0])]
            rounds = [r for r, _ in curves[0]]
            values = np.mean([[v for _, v in c] for c in curves], axis=0)
            for r, v in zip(rounds, values):
                writer.writerow([name, r, f"{v:.6g}", len(curves)])
            ax.plot(rounds, values, label=name)
            lines.append(f"| {name} | {np.mean(values[-args.tail:]):.4g} |")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel(args.metric)
    ax.set_title(Path(args.config).stem)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    (out / "summary.md").write_text(f"# {Path(args.config).name}: {args.metric}\n\n" + "\n".join(lines) + "\n")
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
