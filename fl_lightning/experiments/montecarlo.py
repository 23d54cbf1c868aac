"""Monte Carlo study: R independent runs (seeds) of fit configs, compared on the cost error.

Each run ``r`` is ``fl-lightning fit`` of a config with ``seed_everything = data.init_args.seed =
base_seed + r`` (activation draws and minibatch picks change; the data and any seeded
probabilities, set elsewhere in the config, stay fixed). A ``GlobalCost`` callback records the
federated objective f(theta^k) after every round and f* (L-BFGS on all data). Reported per series:

- per round: mean and variance (across runs, ddof = 1) of the cost error f(theta^k) - f*;
- the CEP radius of the final parameters: median distance of the runs' theta^K from their mean
  (Rostami & Kia, Sec. VI).

Usage::

    python -m fl_lightning.experiments.montecarlo --config configs/svrg_least_squares.yaml --runs 20 --out DIR
    python -m fl_lightning.experiments.montecarlo --spec configs/svrg_least_squares_mc.yaml --out DIR

``--config`` (repeatable) compares fit configs in one case; ``--spec`` is a YAML file of several
cases (see ``configs/svrg_least_squares_mc.yaml``). Writes ``summary.md``, ``rounds.csv`` and, per
case, ``cost_error_<case>.png``, ``variance_<case>.png`` and ``cep_<case>.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml


_QUIET = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"]


@dataclass
class Series:
    """One algorithm/config of a case: ``config`` plus dotted CLI overrides."""

    label: str
    config: str
    overrides: dict = field(default_factory=dict)


@dataclass
class SeriesResult:
    label: str
    cost: np.ndarray  # [R, rounds + 1], f(theta^k)
    optimum: float  # f*
    final: np.ndarray  # [R, d], theta^K flattened
    active: np.ndarray  # [R], mean active clients per round
    seconds: float

    @property
    def error(self) -> np.ndarray:
        return self.cost - self.optimum

    @property
    def cep(self) -> float:
        from fl_lightning.core.metrics import cep_radius  # imports torch: not needed for --help

        return cep_radius(self.final)


def _cli_value(value) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


def run_one(config: str, overrides: dict, seed: int) -> tuple[list[float], float, np.ndarray, float]:
    """One fit; returns (f(theta^k) per round incl. k = 0, f*, final flat params, mean active clients)."""
    import torch
    from lightning.pytorch import Callback

    from fl_lightning.engine.callbacks import GlobalCost
    from fl_lightning.run.cli_app import build as build_cli

    torch.set_num_threads(1)
    args = ["--config", config, "--seed_everything", str(seed), "--data.init_args.seed", str(seed), *_QUIET]
    for key, value in overrides.items():
        args += [f"--{key}", _cli_value(value)]
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI would otherwise warn about our own command line
    try:
        cli = build_cli(args, run=False)
    finally:
        sys.argv = argv
    trainer = cli.trainer
    cost = next((c for c in trainer.callbacks if isinstance(c, GlobalCost)), None)
    if cost is None:
        cost = GlobalCost(optimum=True)
        trainer.callbacks.append(cost)
    cost.optimum = True
    active: list[int] = []

    class CountActiveClients(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            active.append(int(trainer.callback_metrics["train/clients"]))

    trainer.callbacks.append(CountActiveClients())
    module = cli.model
    trainer.fit(module, datamodule=cli.datamodule)
    final = torch.cat([v.reshape(-1) for v in cost.final_params.values()]).double().numpy()
    return cost.history, cost.optimal_cost, final, float(np.mean(active))


def run_series(series: Series, runs: int, base_seed: int, workers: int) -> SeriesResult:
    start = time.time()
    seeds = [base_seed + r for r in range(runs)]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            out = list(pool.map(run_one, [series.config] * runs, [series.overrides] * runs, seeds))
    else:
        out = [run_one(series.config, series.overrides, s) for s in seeds]
    optima = [o[1] for o in out]
    return SeriesResult(
        label=series.label,
        cost=np.array([o[0] for o in out]),
        optimum=float(np.min(optima)),  # identical across runs up to L-BFGS round-off (same data)
        final=np.stack([o[2] for o in out]),
        active=np.array([o[3] for o in out]),
        seconds=time.time() - start,
    )


# ---- outputs -------------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "case"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_case(case: str, results: list[SeriesResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    slug, paths = _slug(case), []

    fig, ax = plt.subplots(figsize=(6, 4))
    for color, res in zip(colors, results):
        err = np.clip(res.error, 1e-12, None)
        for run in err:
            ax.plot(run, color=color, alpha=0.2, lw=0.7)
        ax.plot(np.clip(res.error.mean(0), 1e-12, None), color=color, lw=2.5, label=f"{res.label} (mean)")
    ax.set(yscale="log", xlabel="round k", ylabel="f(theta^k) - f*", title=f"Cost error, {len(results[0].cost)} runs: {case}")
    ax.legend()
    paths.append(_save(fig, out / f"cost_error_{slug}.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for color, res in zip(colors, results):
        ax.plot(np.clip(res.error.var(0, ddof=1), 1e-20, None), color=color, lw=2, label=res.label)
    ax.set(yscale="log", xlabel="round k", ylabel="variance of f(theta^k) across runs", title=f"Variance: {case}")
    ax.legend()
    paths.append(_save(fig, out / f"variance_{slug}.png"))

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 4), squeeze=False)
    lim = max(np.abs(r.final - r.final.mean(0))[:, :2].max() for r in results) * 1.15
    for ax, color, res in zip(axes[0], colors, results):
        dev = res.final - res.final.mean(0)
        ax.scatter(dev[:, 0], dev[:, 1], s=14, color=color)
        ax.add_patch(plt.Circle((0, 0), res.cep, fill=False, color="k", ls="--"))
        ax.set(xlim=(-lim, lim), ylim=(-lim, lim), aspect="equal", xlabel="theta_1 - mean", ylabel="theta_2 - mean")
        ax.set_title(f"{res.label}\nCEP = {res.cep:.4f}", fontsize=9)
    fig.suptitle(f"Final parameters around their mean: {case}", fontsize=10)
    paths.append(_save(fig, out / f"cep_{slug}.png"))
    return paths


def write_tables(cases: dict[str, list[SeriesResult]], out: Path, command: str) -> Path:
    lines = [
        "# Monte Carlo summary",
        "",
        f"Command: `{command}`",
        "",
        "Cost error = f(theta^K) - f* after the last round K; variance across runs (ddof = 1); CEP = median "
        "distance of the runs' final theta from their mean (all coordinates).",
        "",
        "| case | algorithm | runs | rounds | f* | mean cost error | variance of cost error | CEP radius | mean active clients | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = ["case,algorithm,round,mean_cost_error,var_cost_error"]
    for case, results in cases.items():
        for res in results:
            err = res.error
            lines.append(
                f"| {case} | {res.label} | {len(err)} | {err.shape[1] - 1} | {res.optimum:.6g} | {err[:, -1].mean():.3e} | "
                f"{err[:, -1].var(ddof=1):.3e} | {res.cep:.4f} | {res.active.mean():.2f} | {res.seconds:.0f} |"
            )
            var = err.var(0, ddof=1) if len(err) > 1 else np.zeros(err.shape[1])
            rows += [f'"{case}","{res.label}",{k},{m:.6e},{v:.6e}' for k, (m, v) in enumerate(zip(err.mean(0), var))]
    (out / "rounds.csv").write_text("\n".join(rows) + "\n")
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- entry point -----------------------------------------------------------------------------------------
def load_spec(path: str) -> tuple[dict[str, list[Series]], dict]:
    """``{runs, base_seed, cases: {case: {label: config_path | {config, overrides}}}}``."""
    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("cases"), dict) or not spec["cases"]:
        raise ValueError(f"--spec {path}: needs a non-empty 'cases' mapping of case -> label -> config")
    cases = {}
    for case, entries in spec["cases"].items():
        cases[str(case)] = [
            Series(str(label), e, {}) if isinstance(e, str) else Series(str(label), e["config"], dict(e.get("overrides") or {}))
            for label, e in entries.items()
        ]
    return cases, spec


def main(argv: list[str] | None = None) -> dict[str, list[SeriesResult]]:
    parser = argparse.ArgumentParser(prog="fl-lightning montecarlo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=[], help="fit config (repeatable: one series each)")
    parser.add_argument("--spec", help="YAML of several cases (overrides --config)")
    parser.add_argument("--runs", type=int, default=None, help="Monte Carlo runs R (default: spec's runs, else 20)")
    parser.add_argument("--seed", type=int, default=None, help="seed of run 0; run r uses seed + r (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted CLI override for every run")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)

    if args.spec:
        cases, spec = load_spec(args.spec)
    elif args.config:
        cases, spec = {"study": [Series(Path(c).stem, c) for c in args.config]}, {}
    else:
        parser.error("give --config (one or more) or --spec")
    runs = args.runs if args.runs is not None else int(spec.get("runs", 20))
    base_seed = args.seed if args.seed is not None else int(spec.get("base_seed", 0))
    if runs < 2:
        parser.error(f"--runs must be >= 2 (variance and CEP need several runs), got {runs}")
    extra = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set expects KEY=VALUE, got {item!r}")
        extra[key] = yaml.safe_load(value)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[SeriesResult]] = {}
    for case, series in cases.items():
        results[case] = []
        for s in series:
            print(f"[montecarlo] {case} / {s.label}: {runs} runs of {s.config}", file=sys.stderr, flush=True)
            results[case].append(run_series(Series(s.label, s.config, {**s.overrides, **extra}), runs, base_seed, args.workers))
        plot_case(case, results[case], out)
        command = "python -m fl_lightning.experiments.montecarlo " + " ".join(argv if argv is not None else sys.argv[1:])
        summary = write_tables(results, out, command)  # rewritten after every case: partial results survive
    print(summary.read_text())
    return results


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
