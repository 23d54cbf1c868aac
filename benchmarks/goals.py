"""The speed goals of batched and compiled execution, read from ``benchmarks/run.py`` result files.

    python benchmarks/goals.py RESULT.json [RESULT.json ...]   # several invocations: each goal's median
    python benchmarks/goals.py --json RESULT.json ...          # the same, machine-readable

Every goal is a ratio of two rows of one invocation (``run.py`` interleaves the executions of a workload in one
process, so machine noise hits both alike): a goal holds, or not, on the machine that ran it, whatever its speed.
Given several files (repeated invocations on one machine), a goal's value is the median of its per-invocation
values, the runs listed beside it. ``benchmarks/device_check.sh``'s file is read too, each of its steps an
invocation. A goal whose rows are in none of the files is "not measured", with the ``run.py`` options that measure it.

The goals (docs/performance.md, "The speed goals at a glance"):

- batched compiled execution at >= 70 % of the generic compiled program's client-steps per second (``vmap`` of
  ``grad`` through ``functional_call`` under ``torch.compile``, what ``torch.func`` gives any model) on the MLP at
  S = 10, 50 and 200, and at >= 80 % of ``one_batch_compiled`` (the arithmetic floor of stacking) at S = 200;
- the realistic workloads (Dirichlet(0.1) clients, local epochs, stragglers): every round stacked, batched compiled
  >= 8x the bare loop on the MLP (S = 50) and >= 2x on the digits CNN (S = 20);
- sequential execution: compiled >= 1.5x and eager >= 0.95x the bare loop, on every workload measured;
- ``execution: auto`` (trial rounds included) >= 1.0x the bare loop on the realistic digits CNN on a CPU.

The quickstart's end-to-end goal (compiled, warm cache, no slower than eager) is a wall-clock comparison of two
CLI runs, not a ``run.py`` row: docs/performance.md gives its commands.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

Rows = dict[tuple[str, str, int], dict]  # (workload, execution, S) -> row, of one invocation


class Goal(NamedTuple):
    """One goal: ``value(rows)`` of an invocation's rows (None where a row it needs is missing) against ``target``."""

    name: str
    target: float
    value: Callable[[Rows], float | None]
    measure: str  # the run.py options that measure it


def _throughput_ratio(workload: str, clients: int, execution: str, reference: str) -> Callable[[Rows], float | None]:
    def value(rows: Rows) -> float | None:
        row, ref = rows.get((workload, execution, clients)), rows.get((workload, reference, clients))
        if row is None or ref is None or not ref["client_steps_per_s"]:
            return None
        return row["client_steps_per_s"] / ref["client_steps_per_s"]

    return value


def _stacked_fraction(workload: str, clients: int, execution: str) -> Callable[[Rows], float | None]:
    def value(rows: Rows) -> float | None:
        row = rows.get((workload, execution, clients))
        return None if row is None or row.get("stacked_fraction") is None else float(row["stacked_fraction"])

    return value


def goals() -> list[Goal]:
    """Every goal, in the order they are reported."""
    idealised = "--workloads mlp,mlp400 --executions bare,batched_compiled,batched_compiled_round,generic_compiled,one_batch_compiled"
    realistic = "--workloads mlp_realistic,cnn_realistic --executions bare,batched_compiled"
    sequential = "--workloads mlp,mlp400,mlp_realistic --executions bare,sequential,sequential_compiled"
    listed = [
        *(Goal(f"batched compiled / generic compiled, {w} S = {s}", 0.70, _throughput_ratio(w, s, "batched_compiled", "generic_compiled"), idealised)
          for w, s in (("mlp", 10), ("mlp", 50), ("mlp400", 200))),
        Goal("batched compiled / one_batch compiled, mlp400 S = 200", 0.80,
             _throughput_ratio("mlp400", 200, "batched_compiled", "one_batch_compiled"), idealised),
        *(Goal(f"compiled round / generic compiled, {w} S = {s}", 0.70, _throughput_ratio(w, s, "batched_compiled_round", "generic_compiled"), idealised)
          for w, s in (("mlp", 10), ("mlp", 50), ("mlp400", 200))),
        *(Goal(f"rounds stacked, {w} S = {s} batched compiled", 1.0, _stacked_fraction(w, s, "batched_compiled"), realistic)
          for w, s in (("mlp_realistic", 50), ("cnn_realistic", 20))),
        Goal("batched compiled x bare, mlp_realistic S = 50", 8.0, _throughput_ratio("mlp_realistic", 50, "batched_compiled", "bare"), realistic),
        Goal("batched compiled x bare, cnn_realistic S = 20", 2.0, _throughput_ratio("cnn_realistic", 20, "batched_compiled", "bare"), realistic),
        Goal("auto x bare, cnn_realistic S = 20 (CPU; 2.0 on a GPU)", 1.0, _throughput_ratio("cnn_realistic", 20, "auto", "bare"),
             "--workloads cnn_realistic --executions bare,sequential,batched,auto"),
    ]  # fmt: skip
    for execution, target in (("sequential_compiled", 1.5), ("sequential", 0.95)):
        label = "sequential compiled" if execution == "sequential_compiled" else "eager sequential"
        listed += [
            Goal(f"{label} x bare, {w} S = {s}", target, _throughput_ratio(w, s, execution, "bare"), sequential)
            for w, s in (("mlp", 10), ("mlp", 50), ("mlp400", 200), ("mlp_realistic", 50))
        ]
    return listed


def invocations(document: dict) -> list[list[dict]]:
    """The rows of each invocation in a result file: ``run.py``'s (one), or ``device_check``'s (one per step)."""
    if "steps" in document:
        return [step["rows"] for step in document["steps"] if step.get("rows")]
    return [document["rows"]] if document.get("rows") else []


def _keyed(rows: Sequence[dict]) -> Rows:
    return {(r["workload"], r["execution"], int(r["clients_per_round"])): r for r in rows}


def evaluate(documents: Sequence[dict]) -> list[dict]:
    """Each goal's target, per-invocation values, median and whether the median meets it (None: not measured)."""
    runs = [_keyed(rows) for document in documents for rows in invocations(document)]
    report = []
    for goal in goals():
        values = [v for v in (goal.value(rows) for rows in runs) if v is not None]
        median = statistics.median(values) if values else None
        report.append({
            "goal": goal.name, "target": goal.target, "median": median, "runs": values,
            "met": None if median is None else median >= goal.target, "measure": goal.measure,
        })  # fmt: skip
    return report


def machines(documents: Sequence[dict]) -> list[str]:
    """The distinct machines of the files, in words (goals hold per machine: mixing them is reported)."""
    return list(dict.fromkeys(_machine_words(document.get("machine", {})) for document in documents))


def _machine_words(m: dict) -> str:
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (f", {m['gpu']}" if m.get("gpu") else "") + f", torch {m.get('torch', '?')}"


def settings(documents: Sequence[dict]) -> list[str]:
    """The distinct compiled-execution settings of the files (``run.py --compile-unit / --steps-per-call``; none: defaults)."""
    return list(dict.fromkeys(_settings_words(document) for document in documents))


def _settings_words(document: dict) -> str:
    return ", ".join(f"{k} {document[k]}" for k in ("compile_unit", "steps_per_call") if document.get(k)) or "default compile settings"


def table(report: Sequence[dict]) -> str:
    lines = ["| goal | target | median | runs | met |", "|---|---|---|---|---|"]
    for entry in report:
        if entry["median"] is None:
            lines.append(f"| {entry['goal']} | {entry['target']:g} | not measured (`run.py {entry['measure']}`) | | |")
            continue
        runs = ", ".join(f"{v:.2f}" for v in entry["runs"])
        lines.append(f"| {entry['goal']} | {entry['target']:g} | {entry['median']:.2f} | {runs} | {'yes' if entry['met'] else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="result files of benchmarks/run.py (or benchmarks/device_check.sh)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    documents = []
    for path in args.results:
        try:
            documents.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            print(f"goals: cannot read {path}: {error}", file=sys.stderr)
            return 2
    if not any(invocations(d) for d in documents):
        print(f"goals: no benchmark rows in {', '.join(args.results)} (files of benchmarks/run.py or device_check.sh)", file=sys.stderr)
        return 2
    report, seen, compiled = evaluate(documents), machines(documents), settings(documents)
    if args.json:
        print(json.dumps({"machines": seen, "settings": compiled, "goals": report}, indent=1))
        return 0
    for what, found in (("machines", seen), ("compile settings", compiled)):
        if len(found) > 1:
            print(f"warning: the files come from {len(found)} {what}; each goal's runs mix them", file=sys.stderr)
    measured = [e for e in report if e["met"] is not None]
    count = sum(len(invocations(d)) for d in documents)
    print(f"machine: {'; '.join(seen)}; {'; '.join(compiled)}; {count} invocation(s)")
    print(table(report))
    print(f"{sum(e['met'] for e in measured)} of {len(measured)} measured goals met; {len(report) - len(measured)} not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
