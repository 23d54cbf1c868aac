"""What composes with what, read from the stages' declarations (docs/architecture.md, "Round stages"):
``check_composition`` refuses a chain in one line naming both settings; ``composition_table`` is the
docs' table, generated from the same declarations (a test compares the two)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fl_lightning.rounds.stage import RoundStage


def check_composition(stages: Sequence[RoundStage]) -> None:
    """One ``ValueError`` for the first pair of stages that cannot run together (in round order), and
    for two stages of one name."""
    ordered = sorted(stages, key=lambda s: s.order)
    names = [s.name for s in ordered]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"two round stages are named {twice!r}; a stage's name is unique in a round")
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            reason = first.conflict_with(second) or second.conflict_with(first)
            if reason is not None:
                raise ValueError(reason if _names_both(reason, first, second) else f"{first.setting} with {second.setting}: {reason}")


def _names_both(reason: str, first: RoundStage, second: RoundStage) -> bool:
    words = (first.setting.split("model.")[-1], second.setting.split("model.")[-1])
    return all(w and w in reason for w in words)


def composition_table(stage_classes: Iterable[type[RoundStage]], drivers: Iterable[type] = ()) -> str:
    """The markdown table of docs/architecture.md: each stage's setting, its place in the round, whether it
    needs every upload in one place, and what it cannot run beside (with the reason)."""
    rows = ["| stage | setting | order | every upload in one place | cannot run beside |", "|---|---|---|---|---|"]
    for cls in sorted(stage_classes, key=lambda c: (c.order, c.name)):
        refused = "; ".join(f"{other}: {why}" for other, why in sorted(cls.conflicts.items())) or "-"
        reads = cls.reads_each_upload if isinstance(cls.reads_each_upload, str) else "yes" if cls.reads_each_upload else "no"
        rows.append(f"| {cls.name} | {cls.setting or '-'} | {cls.order} | {reads} | {refused} |")
    for driver in drivers:
        refused = "; ".join(f"{other}: {why}" for other, why in sorted(driver.conflicts.items()))
        rows.append(f"| {driver.name} (driver) | {driver.setting} | - | no | {refused} |")
    return "\n".join(rows)
