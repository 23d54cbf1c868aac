"""What ``fl-lightning tune`` checks before its first trial (the equal budget) and writes after its last: summary.md and
summary.csv (each method's test accuracy on fresh seeds beside the budget it had), best_so_far.png (the best value
against trials) and best/<method>.yaml (the chosen settings as a fit config)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

from fl_lightning.experiments.study import Study
from fl_lightning.experiments.sweep import dir_name


def clients_per_round(data: Any) -> float | None:
    """The clients a round selects: S of uniform sampling, the expected count of Bernoulli participation (round 0)."""
    participation, num_clients = getattr(data, "participation", None), getattr(data, "num_clients", None)
    if participation is None or num_clients is None:
        return None
    if callable(getattr(participation, "count", None)):
        return float(participation.count(num_clients))
    if callable(getattr(participation, "probabilities_at", None)):
        return float(participation.probabilities_at(0, num_clients).sum())
    return None


def check_validation_split(data: Any, study: Study) -> None:
    """Tuning on the test set would make the test meaningless: the metric must come from a validation split."""
    if study.metric.startswith("val/") and not getattr(data, "val_fraction", 0):
        raise ValueError(
            f"study {study.path}: metric {study.metric} would be the test set (the base config has no validation split); "
            "set data.init_args.val_fraction in (0, 1) in overrides"
        )


def counts(optuna_study: Any) -> dict[str, int]:
    """The study's trials by state: complete, pruned, fail, running."""
    states = [t.state.name for t in optuna_study.get_trials(deepcopy=False)]
    return {name: states.count(name.upper()) for name in ("complete", "pruned", "fail", "running")}


def budgets(study: Study, out: Path) -> list[str]:
    """Build every method's config once (a bad key: one line, before any trial), check that the methods get equal
    budgets (trials x rounds x clients per round) unless the study allows otherwise, and return the lines to print."""
    from fl_lightning.experiments.compare import _build

    each = {}
    for name, method in study.methods.items():
        cli = _build(study.args(name, {}, study.seed, study.trial_dir(out, name, 0)))
        check_validation_split(cli.datamodule, study)
        searched = [p.key for p in method.space if "participation" in p.key or "num_clients" in p.key]
        if searched and not study.unequal_budgets:
            raise ValueError(f"study {study.path}: methods.{name}.space searches {searched[0]}, so trials differ in budget; "
                             "set unequal_budgets: true to allow it")  # fmt: skip
        each[name] = (method.trials, method.rounds, clients_per_round(cli.datamodule))
    lines = [f"[tune] {name}: {budget_text(*b)}" for name, b in each.items()]
    if len({b for b in each.values()}) > 1:
        if not study.unequal_budgets:
            raise ValueError(f"study {study.path}: the methods' budgets differ ({'; '.join(l.removeprefix('[tune] ') for l in lines)}); "
                             "give every method the same trials, rounds and clients per round, or set unequal_budgets: true")  # fmt: skip
        return ["[tune] UNEQUAL budgets (unequal_budgets: true):", *lines]
    name, budget = next(iter(each.items()))
    return [f"[tune] budget of each method: {budget_text(*budget)} (equal for all {len(each)} methods)"]


def budget_text(trials: int, rounds: int, clients: float | None) -> str:
    if clients is None:
        return f"{trials} trials x {rounds} rounds (clients per round not fixed by the participation)"
    return f"{trials} trials x {rounds} rounds x {clients:g} clients per round = {trials * rounds * clients:,.0f} client-rounds"


def rows(study: Study, tuner: Any, tested: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per method: its trials, budget, best trial and test accuracy over the test seeds."""
    table = []
    for name, method in study.methods.items():
        optuna_study = tuner.optuna_study(name)
        trials = optuna_study.get_trials(deepcopy=False)
        done = counts(optuna_study)
        complete = [t for t in trials if t.value is not None and t.state.name == "COMPLETE"]
        best = optuna_study.best_trial if complete else None
        accs = [r["test_acc"] for r in tested.get(name, []) if r.get("status") == "ok" and r.get("test_acc") is not None]
        table.append({
            "method": name, "trials": method.trials, "complete": done["complete"], "pruned": done["pruned"], "failed": done["fail"],
            "rounds": method.rounds, "rounds_trained": sum(t.user_attrs.get("rounds", 0) for t in trials),
            "best_trial": best.number if best else None, "best_value": best.value if best else None,
            "test_acc_mean": statistics.fmean(accs) if accs else None, "test_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0 if accs else None,
            "test_runs": len(accs), "seconds": round(sum(t.user_attrs.get("seconds", 0.0) for t in trials), 1),
            "cpu_seconds": round(sum(t.user_attrs.get("cpu_seconds", 0.0) for t in trials), 1),
            "best_params": json.dumps(best.params) if best else "",
        })  # fmt: skip
    return table


def report(study: Study, out: Path, tuner: Any, tested: dict[str, list[dict[str, Any]]]) -> list[Path]:
    table = rows(study, tuner, tested)
    written = [_csv(out / "summary.csv", table), _markdown(out / "summary.md", study, table), _plot(out / "best_so_far.png", study, tuner)]
    written += _configs(out / "best", study, tuner)
    return written


def _csv(path: Path, table: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return path


def _markdown(path: Path, study: Study, table: list[dict[str, Any]]) -> Path:
    seeds = ", ".join(map(str, study.test_seeds)) or "none"
    lines = [
        f"# Tuning study {Path(study.path).name}", "",
        f"Each method: {study.methods[table[0]['method']].trials} trials of {study.methods[table[0]['method']].rounds} rounds "
        f"({'unequal budgets allowed' if study.unequal_budgets else 'the same budget for every method'}), scored by "
        f"{study.metric} ({study.direction}) at a trial's last evaluation; sampler {study.sampler['name']}, pruner {study.pruner['name']}. "
        f"Test accuracy: the best trial's settings re-run on fresh seeds ({seeds}), the global model on the test set once.", "",
        f"| method | test acc (mean ± std) | best {study.metric} (tuning) | trials complete / pruned / failed | rounds trained | wall s | CPU s | best settings |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in table:
        test = "n/a" if r["test_acc_mean"] is None else f"{100 * r['test_acc_mean']:.1f} ± {100 * r['test_acc_std']:.1f} (n={r['test_runs']})"
        best = "n/a" if r["best_value"] is None else f"{r['best_value']:.4f} (trial {r['best_trial']})"
        lines.append(f"| {r['method']} | {test} | {best} | {r['complete']} / {r['pruned']} / {r['failed']} | {r['rounds_trained']} "
                     f"| {r['seconds']:.0f} | {r['cpu_seconds']:.0f} | `{r['best_params']}` |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def best_so_far(values: list[float | None], maximize: bool) -> list[float | None]:
    """The best value among trials 0..i (None before the first complete trial)."""
    best, curve = None, []
    for value in values:
        if value is not None and (best is None or (value > best if maximize else value < best)):
            best = value
        curve.append(best)
    return curve


def _plot(path: Path, study: Study, tuner: Any) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in study.methods:
        trials = sorted(tuner.optuna_study(name).get_trials(deepcopy=False), key=lambda t: t.number)
        finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
        curve = best_so_far([t.value if t.state.name == "COMPLETE" else None for t in finished], study.direction == "maximize")
        ax.plot(range(1, len(curve) + 1), [float("nan") if v is None else v for v in curve], marker=".", label=name)
    ax.set_xlabel("trials finished (complete or pruned)")
    ax.set_ylabel(f"best {study.metric} so far")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """Dotted CLI keys as a nested config mapping (later keys inside earlier mappings: ``model.algorithm`` then
    ``model.algorithm.init_args.mu``)."""
    tree: dict[str, Any] = {}
    for key, value in dotted.items():
        node, *parts, last = [tree, *key.split(".")]
        for part in parts:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _configs(folder: Path, study: Study, tuner: Any) -> list[Path]:
    """Each method's best settings as a fit config on top of the study's base: ``fl-lightning fit --config best/<m>.yaml``."""
    folder.mkdir(exist_ok=True)
    written = []
    for name, method in study.methods.items():
        optuna_study = tuner.optuna_study(name)
        if not any(t.state.name == "COMPLETE" for t in optuna_study.get_trials(deepcopy=False)):
            continue
        keys = {**study.overrides, **method.set, **optuna_study.best_trial.params,
                "trainer.max_steps": method.rounds, "trainer.val_check_interval": study.evaluate_every}  # fmt: skip
        config = {"base": str(study.base), **nested({k: v for k, v in keys.items() if not k.endswith("+")})}
        path = folder / f"{dir_name(name)}.yaml"
        header = f"# {name}: the best trial ({study.metric} {optuna_study.best_value:.4f}) of tuning study {Path(study.path).name}\n"
        path.write_text(header + yaml.safe_dump(config, sort_keys=False))
        written.append(path)
    return written
