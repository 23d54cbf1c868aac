"""Tables of a comparison: final accuracy, wall time and cost-to-target (Table 1 of the
parameter-tracking paper: runs as columns, mean ± std over seeds, ">B" when not reached),
as Markdown (``summary.md``), LaTeX (``summary.tex``) and per-seed CSV (``summary.csv``).

Accuracies are percentages with one decimal. A run x seed that failed or diverged is left out
of the means; the "Status" row says which seeds and why ("seed 1: diverged at round 12"), and a
run none of whose seeds finished shows its failure instead of numbers.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fl_lightning.experiments.history import ACC, BYTES, COSTS, PER_CLIENT, ROUND, TEST_ACC, UPLOADS, History, cost_to_target, mean_std

SCALE = {BYTES: 1e-6}  # bytes are reported in MB
DIGITS = {ROUND: 1, PER_CLIENT: 1, UPLOADS: 1, BYTES: 2}
NO_VALUE = "—"


def fmt_mean_std(values: Sequence[float], digits: int, scale: float = 1.0) -> str:
    if not len(values):
        return NO_VALUE
    mean, std = mean_std([v * scale for v in values])
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def cost_cell(histories: Sequence[History], target: float, cost: str) -> tuple[str, list[tuple[bool, float]]]:
    """The table cell of one run and its per-seed (reached, value) pairs.

    All seeds reached: mean ± std. Otherwise ">B", B the mean over seeds of the cost
    (reached) or the budget spent (not reached), a lower bound of the mean cost, with
    "(k/n)" when k of n seeds reached. B has the same decimals as the mean ± std cells.
    """
    scale, digits = SCALE.get(cost, 1.0), DIGITS.get(cost, 1)
    costs = [cost_to_target(h, target, cost) for h in histories]
    values = [(c.reached, c.value * scale) for c in costs]
    if not values:
        return NO_VALUE, values
    reached = sum(r for r, _ in values)
    if reached == len(values):
        return fmt_mean_std([v for _, v in values], digits), values
    bound = sum(v for _, v in values) / len(values)
    return f">{bound:.{digits}f}" + (f" ({reached}/{len(values)})" if reached else ""), values


@dataclass
class Table:
    title: str
    note: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)


def _markdown(table: Table) -> list[str]:
    lines = [f"## {table.title}", ""] + ([table.note, ""] if table.note else [])
    lines += ["| " + " | ".join(table.header) + " |", "|" + "|".join(["---"] * len(table.header)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in table.rows] + [""]


_LATEX = {
    **{ch: "\\" + ch for ch in "&%$#_{}"},
    "±": "$\\pm$",
    ">": "$>$",
    "—": "---",
    "~": "\\textasciitilde{}",
    "^": "\\textasciicircum{}",
    "\\": "\\textbackslash{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


def _latex(table: Table) -> list[str]:
    lines = [
        "\\begin{table}[t]",
        "\\centering",
        f"\\caption{{{_latex_escape(table.title)}}}",
        f"\\begin{{tabular}}{{{'l' * len(table.header)}}}",
        "\\toprule",
        " & ".join(_latex_escape(h) for h in table.header) + " \\\\",
        "\\midrule",
    ]
    lines += [" & ".join(_latex_escape(c) for c in row) + " \\\\" for row in table.rows]
    return lines + ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]


def _status_text(status: Sequence[str | None], seeds: Sequence[int]) -> str:
    failures = [(s, text) for s, text in zip(seeds, status) if text]
    if not failures:
        return "ok"
    if len(failures) == len(seeds) and len({t for _, t in failures}) == 1:
        return failures[0][1] + ("" if len(seeds) == 1 else " (every seed)")
    return "; ".join(f"seed {s}: {text}" for s, text in failures)


def summary_tables(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    targets: Sequence[float],
    long_rows: list[list] | None = None,
    statuses: Mapping[str, Sequence[str | None]] | None = None,
    seconds: Mapping[str, Sequence[float | None]] | None = None,
) -> list[Table]:
    """The accuracy table and (with targets) the cost-to-target table.

    ``statuses[run][i]`` is None when seed ``seeds[i]`` finished, else its failure
    ("diverged at round 12", "failed: ..."); ``seconds[run][i]`` its ``fit_seconds``.
    ``long_rows`` (if given) collects every per-seed number as
    ``[table, row, target, run, seed, value, reached]`` for ``summary.csv``.
    """
    long_rows = long_rows if long_rows is not None else []
    runs = list(histories)
    statuses = {run: list((statuses or {}).get(run) or [None] * len(histories[run])) for run in runs}
    ok = {run: [i for i, s in enumerate(statuses[run]) if s is None] for run in runs}
    any_failure = any(len(ok[run]) < len(histories[run]) for run in runs)

    def per_seed(run: str) -> list[tuple[int, History]]:
        return [(seeds[i], histories[run][i]) for i in ok[run]]

    def failed_cell(run: str) -> str:
        return _status_text(statuses[run], seeds) if not ok[run] else ""

    validated = any(TEST_ACC in r for hs in histories.values() for h in hs for r in h.records)
    if validated:  # a validation split: select on it, report the test set
        how = ("Test accuracy is the global model's accuracy on the global test set (`test/acc`); the "
               "\"selected\" row is the test accuracy at the evaluation with the best validation accuracy (`val/acc`).")
        measures = (("Final test accuracy (%)", lambda h: h.final(TEST_ACC)),
                    ("Test accuracy at best validation (%)", lambda h: h.at_best(ACC, TEST_ACC)),
                    ("Final validation accuracy (%)", lambda h: h.final(ACC)))  # fmt: skip
    else:
        how = ("Test accuracy is the global model's accuracy on the global test set (`val/acc`: there is no "
               "validation split, set `data.init_args.val_fraction` for one); \"best\" is the highest "
               "evaluation of a run, so it is selected on the test set.")
        measures = (("Final test accuracy (%)", lambda h: h.final(ACC)), ("Best test accuracy (%)", lambda h: h.best(ACC)))
    accuracy = Table(
        "Final test accuracy",
        f"Mean ± std (sample, ddof=1) over seeds {list(seeds)}, in %. {how} "
        "A seed that failed or diverged is left out of the means (see Status).",
        ["", *runs],
    )
    for row, fn in measures:
        cells = []
        for run in runs:
            values = [(s, fn(h)) for s, h in per_seed(run)]
            long_rows += [["accuracy", row.replace(" (%)", ""), "", run, s, v, ""] for s, v in values]
            cells.append(failed_cell(run) or fmt_mean_std([v for _, v in values], 1, scale=100.0))
        accuracy.rows.append([row, *cells])
    rounds = []
    for run in runs:
        values = [(seeds[i], histories[run][i].last(ROUND)) for i in range(len(histories[run]))]
        values = [(s, v) for s, v in values if not math.isnan(v)]
        long_rows += [["accuracy", "Rounds run", "", run, s, v, ""] for s, v in values]
        rounds.append(fmt_mean_std([v for _, v in values], 1))
    accuracy.rows.append(["Rounds run", *rounds])
    if seconds is not None:
        cells = []
        for run in runs:
            values = [(seeds[i], seconds[run][i]) for i in ok[run] if seconds.get(run) and seconds[run][i] is not None]
            long_rows += [["accuracy", "Wall time (s)", "", run, s, v, ""] for s, v in values]
            cells.append(fmt_mean_std([v for _, v in values], 1))
        accuracy.rows.append(["Wall time (s)", *cells])
    if any_failure:
        accuracy.rows.append(["Status", *(_status_text(statuses[run], seeds) for run in runs)])
    tables = [accuracy]

    if targets:
        logged = {m for hs in histories.values() for h in hs for m in h.metrics()}
        cost_table = Table(
            "Cost to reach the target test accuracy",
            "First evaluation at or above the target (resolution: the evaluation interval). "
            "\">B\": not reached by every seed; B is the mean over seeds of the cost, or of the budget "
            "spent by seeds that never reached it (a lower bound); (k/n): k of n seeds reached it. "
            "Communication per client counts model-sized messages (up + down) per participating client.",
            ["Setting", "Target", *runs],
        )
        for cost, name in COSTS.items():
            if cost not in logged:
                continue
            for target in targets:
                cells = []
                for run in runs:
                    pairs = per_seed(run)
                    cell, values = cost_cell([h for _, h in pairs], target, cost)
                    long_rows += [["cost", name, target, run, s, v, r] for (s, _), (r, v) in zip(pairs, values)]
                    cells.append(failed_cell(run) or cell)
                cost_table.rows.append([name, f"{target:g}", *cells])
        tables.append(cost_table)
    return tables


def summary_markdown(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    targets: Sequence[float],
    title: str = "",
    long_rows: list[list] | None = None,
    statuses: Mapping[str, Sequence[str | None]] | None = None,
    seconds: Mapping[str, Sequence[float | None]] | None = None,
) -> str:
    """``summary.md``: the tables of ``summary_tables`` with a pointer to the files."""
    lines = [f"# {title}".rstrip(), "", "Curves: `overview.png` and `plots/*.png` (their data: `plots/*.csv`); "
             "per-seed numbers of these tables: `summary.csv`; LaTeX: `summary.tex`; run logs: "
             "`runs/<name>/seed<s>/metrics.csv`.", ""]  # fmt: skip
    for table in summary_tables(histories, seeds, targets, long_rows, statuses, seconds):
        lines += _markdown(table)
    return "\n".join(lines)


def summary_latex(tables: Sequence[Table]) -> str:
    """``summary.tex``: one booktabs ``table`` per summary table (needs ``\\usepackage{booktabs}``)."""
    lines = ["% fl-lightning compare summary; needs \\usepackage{booktabs}", ""]
    for table in tables:
        lines += _latex(table)
    return "\n".join(lines)


def write_summary(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    targets: Sequence[float],
    out: Path,
    title: str = "",
    statuses: Mapping[str, Sequence[str | None]] | None = None,
    seconds: Mapping[str, Sequence[float | None]] | None = None,
) -> tuple[Path, Path, Path]:
    """``out/summary.md``, ``out/summary.tex`` and ``out/summary.csv`` (the same numbers per seed)."""
    long_rows: list[list] = []
    text = summary_markdown(histories, seeds, targets, title, long_rows, statuses, seconds)
    (out / "summary.md").write_text(text)
    (out / "summary.tex").write_text(summary_latex(summary_tables(histories, seeds, targets, None, statuses, seconds)))
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["table", "row", "target", "run", "seed", "value", "reached"])
        for row in long_rows:
            writer.writerow([repr(float(v)) if isinstance(v, float) and not math.isnan(v) else v for v in row])
    return out / "summary.md", out / "summary.tex", out / "summary.csv"


def first_table_markdown(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    statuses: Mapping[str, Sequence[str | None]] | None = None,
    seconds: Mapping[str, Sequence[float | None]] | None = None,
) -> str:
    """The accuracy table alone (what ``compare`` prints at the end)."""
    (table,) = summary_tables(histories, seeds, [], None, statuses, seconds)
    return "\n".join(_markdown(table)[2 + (2 if table.note else 0):]).rstrip()
