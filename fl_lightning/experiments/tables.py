"""Tables of a comparison: accuracy, wall time and cost-to-target (Table 1 of the
parameter-tracking paper: runs as columns, mean ± std over seeds, ">B" when not reached),
as Markdown (``summary.md``), LaTeX (``summary.tex``) and per-seed CSV (``summary.csv``).

Every row and heading names the split and the model it was measured on (labels.py); targets are
measured on validation and, when the test set is evaluated at every evaluation, on test. Accuracies
are percentages with one decimal; one seed prints no spread; the best mean of a row is bold and
the runs within seed noise of it are marked (noise.py). A run x seed that failed or diverged is
left out of the numbers; its failure is listed once, under "Failures", and a run none of whose
seeds finished shows ``failed`` (or ``diverged``) in its cells.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fl_lightning.experiments.history import ACC, BYTES, COSTS, PER_CLIENT, ROUND, TEST_ACC, UPLOADS, History, cost_to_target, mean_std
from fl_lightning.experiments.labels import AT_BEST_VAL, BEST_ON_TEST, EXTRA, FINAL, METRICS, below_metrics, measured
from fl_lightning.experiments.noise import RULE, marked, marks

SCALE = {BYTES: 1e-6}  # bytes are reported in MB
DIGITS = {ROUND: 1, PER_CLIENT: 1, UPLOADS: 1, BYTES: 2}
NO_VALUE = "—"


def fmt_mean_std(values: Sequence[float], digits: int, scale: float = 1.0) -> str:
    if not len(values):
        return NO_VALUE
    mean, std = mean_std([v * scale for v in values])
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def cost_cell(histories: Sequence[History], target: float, cost: str, metric: str = ACC) -> tuple[str, list[tuple[bool, float]]]:
    """The table cell of one run and its per-seed (reached, value) pairs, the target on ``metric``.

    All seeds reached: mean ± std. Otherwise ">B", B the mean over seeds of the cost
    (reached) or the budget spent (not reached), a lower bound of the mean cost, with
    "(k/n)" when k of n seeds reached. B has the same decimals as the mean ± std cells.
    """
    scale, digits = SCALE.get(cost, 1.0), DIGITS.get(cost, 1)
    costs = [cost_to_target(h, target, cost, metric) for h in histories]
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
    brief: str = ""  # the note's gist, printed with the table on the terminal


def _cells(cells: list[str]) -> str:
    """One markdown table row; a ``|`` inside a cell (e.g. in a run's name) is escaped, not a column break."""
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"


def _markdown(table: Table) -> list[str]:
    lines = [f"## {table.title}", ""] + ([table.note, ""] if table.note else [])
    lines += [_cells(table.header), "|" + "|".join(["---"] * len(table.header)) + "|"]
    return lines + [_cells(row) for row in table.rows] + [""]


_LATEX = {
    **{ch: "\\" + ch for ch in "&%$#_{}"},
    "±": "$\\pm$",
    ">": "$>$",
    "—": "---",
    "≈": "$\\approx$",
    "~": "\\textasciitilde{}",
    "|": "\\textbar{}",  # a bare | is a dash in the default (OT1) text font
    "^": "\\textasciicircum{}",
    "\\": "\\textbackslash{}",
}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX.get(ch, ch) for ch in str(text))


def _latex_cell(text: str) -> str:
    """A cell in LaTeX; Markdown bold (the best of a row) becomes ``\\textbf``."""
    text = str(text)
    if len(text) > 4 and text.startswith("**") and text.endswith("**"):
        return f"\\textbf{{{_latex_escape(text[2:-2])}}}"
    return _latex_escape(text)


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
    lines += [" & ".join(_latex_cell(c) for c in row) + " \\\\" for row in table.rows]
    return lines + ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]


def _status_text(status: Sequence[str | None], seeds: Sequence[int]) -> str:
    failures = [(s, text) for s, text in zip(seeds, status) if text]
    if not failures:
        return "ok"
    if len(failures) == len(seeds) and len({t for _, t in failures}) == 1:
        return failures[0][1] + ("" if len(seeds) == 1 else " (every seed)")
    return "; ".join(f"seed {s}: {text}" for s, text in failures)


def _failed_word(status: Sequence[str | None]) -> str:
    """The cell of a run none of whose seeds finished: ``diverged`` if every seed diverged, else ``failed``."""
    return "diverged" if all(s and s.startswith("diverged") for s in status) else "failed"


def failures_markdown(statuses: Mapping[str, Sequence[str | None]], seeds: Sequence[int]) -> list[str]:
    """The "Failures" section of ``summary.md``: each failed run x seed once (a run's seeds with the
    same failure on one line); nothing when every run finished."""
    lines = [f"- {run}: {_status_text(status, seeds)}" for run, status in statuses.items() if any(status)]
    if not lines:
        return []
    return ["## Failures", "", "Left out of every number above; a run none of whose seeds finished shows "
            "`failed` (or `diverged`) in its cells.", "", *lines, ""]  # fmt: skip


def _with_seeds(cell: str, n: int, total: int) -> str:
    """A mean over fewer seeds than the sweep's says over how many."""
    return cell if n == total or cell == NO_VALUE else f"{cell} ({n} seed{'s' if n != 1 else ''})"


def _split_state(histories: Mapping[str, Sequence[History]]) -> tuple[bool, bool]:
    """(a validation split: ``test/acc`` logged at all, so ``val/acc`` is validation; ``test/acc``
    logged at every evaluation, not only at the end)."""
    hs = [h for runs in histories.values() for h in runs if h.records]
    split = any(TEST_ACC in r for h in hs for r in h.records)
    per_eval = split and all(TEST_ACC in r for h in hs for r in h.records if ACC in r)
    return split, per_eval


def summary_tables(
    histories: Mapping[str, Sequence[History]],
    seeds: Sequence[int],
    targets: Sequence[float],
    long_rows: list[list] | None = None,
    statuses: Mapping[str, Sequence[str | None]] | None = None,
    seconds: Mapping[str, Sequence[float | None]] | None = None,
) -> list[Table]:
    """The accuracy table and (with targets) a cost-to-target table per split.

    Every row names its split and model (``labels.METRICS``); rows of metrics listed there beyond
    ``val/acc`` and ``test/acc`` (per-client, personalized) are added when logged. Targets are
    measured on validation accuracy, and on test accuracy when the test set is evaluated at every
    evaluation. ``statuses[run][i]`` is None when seed ``seeds[i]`` finished, else its failure
    ("diverged at round 12", "failed: ..."); ``seconds[run][i]`` its ``fit_seconds``.
    ``long_rows`` (if given) collects every per-seed number as
    ``[table, row, target, run, seed, value, reached]`` for ``summary.csv``.
    """
    long_rows = long_rows if long_rows is not None else []
    runs = list(histories)
    statuses = {run: list((statuses or {}).get(run) or [None] * len(histories[run])) for run in runs}
    ok = {run: [i for i, s in enumerate(statuses[run]) if s is None] for run in runs}
    any_failure = any(len(ok[run]) < len(histories[run]) for run in runs)
    total = len(seeds)

    def per_seed(run: str) -> list[tuple[int, History]]:
        return [(seeds[i], histories[run][i]) for i in ok[run]]

    def failed_cell(run: str) -> str:
        return _failed_word(statuses[run]) if not ok[run] else ""

    split, test_per_eval = _split_state(histories)
    val, test = measured(ACC, split), METRICS[TEST_ACC]
    if split:
        how = ("Validation: a split held out from the clients' training data (`data.init_args.val_fraction`, "
               "`val/acc`); test: the global test set (`test/acc`). The best-validation row is the test "
               "accuracy at the evaluation with the highest validation accuracy (selected on validation).")
        measures = [(test, FINAL, lambda h: h.final(TEST_ACC))]
        if test_per_eval:
            measures.append((test, AT_BEST_VAL, lambda h: h.at_best(ACC, TEST_ACC)))
        measures.append((val, FINAL, lambda h: h.final(ACC)))
    else:
        how = ("Test: the global test set (`val/acc`: there is no validation split, set "
               "`data.init_args.val_fraction` for one), so the best evaluation is selected on the test set.")
        measures = [(val, FINAL, lambda h: h.final(ACC)), (val, BEST_ON_TEST, lambda h: h.best(ACC))]
    logged = {m for hs in histories.values() for h in hs for m in h.metrics()}
    for metric in [m for m in EXTRA if m in logged] + below_metrics(logged):
        measures.append((measured(metric), FINAL, lambda h, m=metric: h.final(m)))
    models = list(dict.fromkeys(what.model for what, _, _ in measures))
    spread = (f"Mean ± std (sample, ddof=1) over seeds {list(seeds)}" if total > 1
              else f"Seed {seeds[0]} (1 seed, no spread: no difference can be told from seed noise)")  # fmt: skip
    accuracy = Table(
        f"Accuracy ({'test and validation' if split else 'test set'}; {' and '.join(models)})",
        f"{spread}, in %, at the final evaluation of each run unless the row says otherwise. {how} "
        + (f"{RULE} " if total > 1 else "")
        + "A seed that failed or diverged is left out (see Failures).",
        ["Measured on (split, model, evaluation)", *runs],
        brief=f"{spread}, in %." + (" **Bold**: the best mean of a row; ≈: within seed noise of it (summary.md says how)." if total > 1 else ""),
    )
    for what, when, fn in measures:
        row, cells, judged = what.row(when), [], []
        for run in runs:
            values = [(s, fn(h)) for s, h in per_seed(run)]
            values = [(s, v) for s, v in values if not math.isnan(v)]
            long_rows += [["accuracy", row.replace(" (%)", ""), "", run, s, v, ""] for s, v in values]
            judged.append([100.0 * v for _, v in values] if values and not failed_cell(run) else None)
            cells.append(failed_cell(run) or _with_seeds(fmt_mean_std([v for _, v in values], 1, 100.0), len(values), total))
        accuracy.rows.append([row, *(marked(c, m) for c, m in zip(cells, marks(judged, what.higher_is_better)))])
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
        accuracy.rows.append(["Seeds finished", *(f"{len(ok[run])}/{len(histories[run])}" for run in runs)])
    tables = [accuracy]
    if not targets:
        return tables

    on = [(ACC, val)] + ([(TEST_ACC, test)] if test_per_eval else [])
    only_val = split and not test_per_eval  # test/acc logged, but only at the end
    for metric, what in on:
        table = Table(
            f"Cost to reach a target {what.quantity.lower()} ({what.model}, at each evaluation)",
            f"First evaluation with `{metric}` at or above the target (resolution: the evaluation interval). "
            + ("The test set is evaluated only at the end of these runs, so targets are measured on validation "
               "accuracy only. " if only_val else "")
            + "\">B\": not reached by every seed; B is the mean over seeds of the cost, or of the budget "
            "spent by seeds that never reached it (a lower bound); (k/n): k of n seeds reached it. "
            "Communication per client counts model-sized messages (up + down) per participating client. "
            + ("Marks (bold, ≈) as in the accuracy table, among runs whose every seed reached the target." if total > 1 else ""),
            ["Cost", f"Target ({what.quantity.lower()})", *runs],
        )
        for cost, name in COSTS.items():
            if cost not in logged:
                continue
            for target in targets:
                cells, judged = [], []
                for run in runs:
                    pairs = per_seed(run)
                    cell, values = cost_cell([h for _, h in pairs], target, cost, metric)
                    long_rows += [[f"cost: {what.quantity.lower()}", name, target, run, s, v, r]
                                  for (s, _), (r, v) in zip(pairs, values)]  # fmt: skip
                    reached = bool(values) and all(r for r, _ in values) and not failed_cell(run)
                    judged.append([v for _, v in values] if reached else None)
                    cells.append(failed_cell(run) or (_with_seeds(cell, len(values), total) if reached else cell))
                table.rows.append([name, f"{target:g}", *(marked(c, m) for c, m in zip(cells, marks(judged, False)))])
        tables.append(table)
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
    lines += failures_markdown({run: list((statuses or {}).get(run) or []) for run in histories}, seeds)
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
    """The accuracy table alone, under its title and the gist of its note (what ``compare`` prints at the end)."""
    (table,) = summary_tables(histories, seeds, [], None, statuses, seconds)
    return "\n".join([f"{table.title}. {table.brief}", ""] + _markdown(table)[2 + (2 if table.note else 0):]).rstrip()
