"""Which runs of a table row are within seed noise of the row's best.

Rule: the best run has the best mean (highest accuracy, lowest cost); another run is within seed
noise of it when ``|mean - best mean| <= its std + the best's std`` (sample std, ddof=1, over
seeds). A run with fewer than two values has no spread and is not judged; with no such best, no
run of the row is marked.
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.experiments.history import mean_std

BEST, NEAR = "best", "near"
RULE = ("**Bold**: the best mean of a row; ≈: within seed noise of the best "
        "(|mean − best mean| ≤ its std + the best's std, sample std over seeds); an unmarked number "
        "differs from the best by more than the seeds' spread. Runs with one finished seed are not marked.")  # fmt: skip


def marks(values: Sequence[Sequence[float] | None], higher_is_better: bool = True) -> list[str]:
    """Per run: ``"best"``, ``"near"`` (within seed noise of the best) or ``""``; ``None``: not judged."""
    stats = [mean_std(v) if v is not None and len(v) >= 2 else None for v in values]
    judged = [s for s in stats if s is not None]
    if len(judged) < 2:
        return [""] * len(values)
    sign = 1.0 if higher_is_better else -1.0
    best_mean, best_std = max(judged, key=lambda s: sign * s[0])
    out = []
    for s in stats:
        if s is None:
            out.append("")
        elif s[0] == best_mean:
            out.append(BEST)
        elif abs(s[0] - best_mean) <= s[1] + best_std:
            out.append(NEAR)
        else:
            out.append("")
    return out


def marked(cell: str, mark: str) -> str:
    """The Markdown cell with its mark: ``**90.0 ± 1.0**`` or ``88.5 ± 0.5 ≈``."""
    return f"**{cell}**" if mark == BEST else f"{cell} ≈" if mark == NEAR else cell
