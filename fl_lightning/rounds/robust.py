"""Byzantine-robust aggregation as a round stage (``model.robust``; docs/robustness.md; docs/algorithms.md,
(26.1.1)): non-finite uploads excluded as Byzantine, the rule's minimum of clients, and the rule's r in
place of every upload in the algorithm's sum (``fl_lightning/robust/aggregation.py``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core.participation import derive_seed
from fl_lightning.core.tasks import ClientState, ClientTask, Payload
from fl_lightning.reliability.faults import first_non_finite
from fl_lightning.reliability.fingerprint import describe_setting
from fl_lightning.robust.aggregation import Robust
from fl_lightning.robust.record import KeptRecord
from fl_lightning.rounds.stage import FILTER, Round, RoundStage, RunFacts, refusal

log = logging.getLogger(__name__)


class RobustStage(RoundStage):
    name = "robust"
    order = FILTER
    setting = "model.robust"
    reads_each_upload = True
    conflicts = {"privacy": "a rule other than norm_bound is no mean with fixed bounded weights: DP's noise does not cover one client"}

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.robust)

    def __init__(self, robust: Robust) -> None:
        self.robust = robust
        self._record: KeptRecord | None = None
        self._root = None  # (data, FLTrust's RootData drawn from it)

    def conflict_with(self, other: RoundStage) -> str | None:
        if other.name == "privacy":
            return refusal(self.robust.check_with_privacy)
        return None

    def check(self, facts: RunFacts) -> None:
        self.robust.check(facts.algorithm, facts.cohort)
        if self.robust.needs_reference and facts.personal_names:
            raise ValueError("robust.rule=fltrust with personal tensors: the server's root update has no personal part; use another rule")
        self._facts = facts
        if facts.rank == 0 and self.robust.rule_impl.selects:  # a rule that keeps every upload has nothing to record
            self._record = KeptRecord(facts.run_dir)
            self._record.start(facts.resumed_round)

    def admit(self, round: Round) -> None:
        """Non-finite uploads are Byzantine: excluded before the rule, counted and named; then the rule's
        assumption on f against the clients left."""
        results = round.results
        bad = [cid for cid, upload in zip(results.client_ids, results.uploads) if first_non_finite(upload) is not None]
        if bad:
            log.warning("round %d: robust.rule=%s excludes non-finite uploads of clients %s", round.plan.round, self.robust.rule, bad)
            round.metrics["robust/nonfinite"] = len(bad)
            round.exclude(bad)
        too_few = self.robust.violation(len(round.results))
        if too_few is not None:  # dropouts, failures or exclusions left fewer clients than the rule's assumption on f
            round.metrics["robust/skipped"] = 1
            round.skip(too_few)

    def combine(self, round: Round, weights: Tensor) -> Payload:
        """Clip and compress (client stages, already applied) -> the robust rule -> r in place of every upload."""
        results = round.results
        uploads, ids = results.uploads, results.client_ids
        if round.malicious is not None:  # the defence's norms split into benign and malicious uploads
            self.robust.mark_malicious(set(round.malicious))
        reference = self._root_update(round) if self.robust.needs_reference else None
        outcome = self.robust.combine(uploads, weights, ids, reference)
        round.metrics.update(outcome.metrics)
        if outcome.kept is not None and self._record is not None:
            self._record.add(round.plan.round, outcome.kept)
        return round_sum(round, [outcome.upload] * len(uploads), weights)

    def _root_update(self, round: Round) -> Payload:
        """FLTrust's g0: the algorithm's client rule run by the server on its root dataset (a fresh client's state,
        the round's broadcast, K local steps, minibatches from (seed, round)); nothing of it is stored."""
        from fl_lightning.executors.sequential import run_task
        from fl_lightning.robust.root_data import ROOT_STREAM, RootData

        facts, data, algorithm = self._facts, self._facts.data, self._facts.algorithm
        if self._root is None or self._root[0] is not data:
            self._root = (data, RootData(data, self.robust.root_size))
        root, local, x = self._root[1], facts.local, round.x
        broadcast = algorithm.broadcast(x, round.server_state, round.info)
        steps = root.num_local_steps(0, local.batch_size, local.steps, local.epochs)
        initial = ClientState(algorithm.client_state_init(x), {})
        task = ClientTask(0, derive_seed(data.seed, round.info.round, ROOT_STREAM), steps, broadcast, lambda: initial)
        with torch.inference_mode(False), torch.enable_grad():
            result = run_task(task, round.info, dataclasses.replace(facts.runtime(private=False), data=root, fail_fast=True))
        return result.upload

    @property
    def root_data(self):
        """FLTrust's root dataset as drawn for this run (None before the first round)."""
        return None if self._root is None else self._root[1]

    def fingerprint(self) -> dict[str, str]:
        return {"robust": describe_setting(self.robust)}

    def checkpoint(self) -> dict[str, Any]:
        return {"robust": self.robust.state_dict()}

    def restore(self, saved: dict[str, Any]) -> None:
        self.robust.load_state_dict(saved.get("robust", {}))


def round_sum(round: Round, uploads: list[Payload], weights: Tensor) -> Payload:
    """The algorithm's ``upload_sum`` of ``uploads`` in this round."""
    return round.algorithm.upload_sum(round.x, uploads, weights, round.info)
