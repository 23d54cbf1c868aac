"""Markdown tables of a comparison: final accuracy and cost-to-target (Table 1 of the
parameter-tracking paper: runs as columns, mean ± std over seeds, ">B" when not reached)."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from fl_lightning.history import ACC, BYTES, COSTS, PER_CLIENT, ROUND, UPLOADS, History, cost_to_target, mean_std

SCALE = {BYTES: 1e-6}  # bytes are reported in MB
DIGITS = {ROUND: 1, PER_CLIENT: 1, UPLOADS: 1, BYTES: 2}


def fmt_mean_std(values: Sequence[float], digits: int) -> str:
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def cost_cell(histories: Sequence[History], target: float, cost: str) -> tuple[str, list[tuple[bool, float]]]:
    """The table cell of one run and its per-seed (reached, value) pairs.

    All seeds reached: mean ± std. Otherwise ">B", B the mean over seeds of the cost
    (reached) or the budget spent (not reached), a lower bound of the mean cost, with
    "(k/n)" when k of n seeds reached.
    """
    scale, digits = SCALE.get(cost, 1.0), DIGITS.get(cost, 1)
    costs = [cost_to_target(h, target, cost) for h in histories]
    values = [(c.reached, c.value * scale) for c in costs]
    reached = sum(r for r, _ in values)
    if reached == len(values):
        return fmt_mean_std([v for _, v in values], digits), values
    bound = sum(v for _, v in values) / len(values)
    bound_digits = 0 if float(bound).is_integer() else digits
    return f">{bound:.{bound_digits}f}" + (f" ({reached}/{len(values)})" if reached else ""), values


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def summary_markdown(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    targets: Sequence[float],
    title: str = "",
    long_rows: list[list] | None = None,
) -> str:
    """``summary.md``; ``long_rows`` (if given) collects every per-seed number as
    ``[table, row, target, run, seed, value, reached]`` for ``summary.csv``."""
    long_rows = long_rows if long_rows is not None else []
    runs = list(histories)
    lines = [f"# {title}".rstrip(), "", f"Mean ± std (sample, ddof=1) over seeds {list(seeds)}. "
             "Test accuracy is the global model's accuracy on the global test set (`val/acc`). "
             "Curves: `overview.png` and `plots/*.png` (their data: `plots/*.csv`); per-seed numbers "
             "of these tables: `summary.csv`; run logs: `runs/<name>/seed<s>/metrics.csv`.", ""]  # fmt: skip

    lines += ["## Final test accuracy", ""]
    rows = []
    for row, fn in (("Final test accuracy", History.final), ("Best test accuracy", History.best)):
        cells = []
        for run in runs:
            values = [fn(h, ACC) for h in histories[run]]
            long_rows += [["accuracy", row, "", run, s, v, ""] for s, v in zip(seeds, values)]
            cells.append(fmt_mean_std(values, 4))
        rows.append([row, *cells])
    rounds = []
    for run in runs:
        values = [h.last(ROUND) for h in histories[run]]
        long_rows += [["accuracy", "Rounds run", "", run, s, v, ""] for s, v in zip(seeds, values)]
        rounds.append(fmt_mean_std(values, 1))
    rows.append(["Rounds run", *rounds])
    lines += _table(["", *runs], rows) + [""]

    if targets:
        logged = {m for hs in histories.values() for h in hs for m in h.metrics()}
        lines += [
            "## Cost to reach the target test accuracy",
            "",
            "First evaluation at or above the target (resolution: the evaluation interval). "
            "\">B\": not reached by every seed; B is the mean over seeds of the cost, or of the budget "
            "spent by seeds that never reached it (a lower bound); (k/n): k of n seeds reached it. "
            "Communication per client counts model-sized messages (up + down) per participating client.",
            "",
        ]
        rows = []
        for cost, name in COSTS.items():
            if cost not in logged:
                continue
            for target in targets:
                cells = []
                for run in runs:
                    cell, values = cost_cell(histories[run], target, cost)
                    long_rows += [["cost", name, target, run, s, v, r] for s, (r, v) in zip(seeds, values)]
                    cells.append(cell)
                rows.append([name, f"{target:g}", *cells])
        lines += _table(["Setting", "Target", *runs], rows) + [""]
    return "\n".join(lines)


def write_summary(
    histories: Mapping[str, Sequence[History]], seeds: Sequence[int], targets: Sequence[float], out: Path, title: str = ""
) -> tuple[Path, Path]:
    """``out/summary.md`` and ``out/summary.csv`` (the same numbers per seed)."""
    long_rows: list[list] = []
    text = summary_markdown(histories, seeds, targets, title, long_rows)
    (out / "summary.md").write_text(text)
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["table", "row", "target", "run", "seed", "value", "reached"])
        for row in long_rows:
            writer.writerow([repr(float(v)) if isinstance(v, float) and not math.isnan(v) else v for v in row])
    return out / "summary.md", out / "summary.csv"
