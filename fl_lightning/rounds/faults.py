"""Simulated client faults as a round stage (``model.faults``; docs/algorithms.md, "Faults"): dropouts
and stragglers drawn from each client's round seed, and the limit on the share of clients that fail."""

from __future__ import annotations

import logging

from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.rounds.stage import SHAPE, Cohort, Round, RoundStage

log = logging.getLogger(__name__)


class FaultsStage(RoundStage):
    name = "faults"
    fusable = True  # it shapes the cohort; a round whose clients then differ in work runs step by step
    order = SHAPE
    setting = "model.faults"

    def __init__(self, faults: ClientFaults) -> None:
        self.faults = faults
        self._stragglers = 0

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.faults) if self.faults.active else None

    def shape_cohort(self, round: Round | None, cohort: Cohort) -> None:
        """Drop the clients whose draw drops them, cut the stragglers' steps (not in the warm-up pass)."""
        self._stragglers = 0
        if not self.faults.active or cohort.warmup:
            return
        keep = []
        for i, (dropped, budget) in enumerate(self.faults.draws(cohort.seeds, cohort.full_steps)):  # every client's draw at once
            if dropped:
                log.warning("round %d: client %d dropped out (never reported)", round.plan.round, cohort.client_ids[i])
                continue
            self._stragglers += budget < cohort.full_steps[i]
            cohort.budgets[i] = budget
            keep.append(i)
        cohort.keep(keep)

    def on_results(self, round: Round) -> None:
        self.faults.check_failures(round.plan.round, len(round.tasks) - len(round.results), len(round.tasks))
        if self.faults.active:
            round.metrics["faults/stragglers"] = self._stragglers
