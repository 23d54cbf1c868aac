"""Record-level DP-SGD's server side as a round stage (``model.record_privacy``; docs/privacy.md): the
refusals and sampling rates before training, every dispatched client's local steps accounted each round,
the accountant's state in the checkpoint. The per-example clipping and noise run in local training
(``ClientRuntime.record_privacy``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fl_lightning.pipeline.record_privacy import RecordPrivacy
from fl_lightning.rounds.stage import ACCOUNT, Round, RoundStage, RunFacts


class RecordPrivacyStage(RoundStage):
    name = "record_privacy"
    order = ACCOUNT
    setting = "model.record_privacy"

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.record_privacy)

    def __init__(self, record_privacy: RecordPrivacy, model: Any) -> None:
        self.record_privacy, self.model = record_privacy, model

    def check(self, facts: RunFacts) -> None:
        self.record_privacy.check(facts.algorithm, self.model, facts.data, facts.local)
        self.record_privacy.prepare(facts.data, facts.local)

    def local_training(self, runtime: Any, private: bool) -> Any:
        """Per-example clipping and noise in every local step (not in evaluation's personalization: ``private`` False)."""
        return dataclasses.replace(runtime, record_privacy=self.record_privacy) if private else runtime

    def on_results(self, round: Round) -> None:
        """Every dispatched task's K_i: the steps that touched its records (failed clients' too)."""
        columns = round.tasks.columns
        round.metrics.update(self.record_privacy.account(columns.client_ids, columns.num_steps))

    def checkpoint(self) -> dict[str, Any]:
        return {"record_privacy": self.record_privacy.state_dict()}

    def restore(self, saved: dict[str, Any]) -> None:
        if "record_privacy" in saved:
            self.record_privacy.load_state_dict(saved["record_privacy"])
