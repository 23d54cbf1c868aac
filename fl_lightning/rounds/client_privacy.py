"""Client-level differential privacy's server side as a round stage (``model.privacy``; docs/privacy.md):
the sampling scheme, sigma (calibrated if asked) and the accountant prepared before training, and the stop
before a round that would spend more than the budget. Its clip and noise are message stages
(``fl_lightning.pipeline.privacy``), run by the ``messages`` stage."""

from __future__ import annotations

from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.rounds.stage import ACCOUNT, RoundStage, RunFacts


class ClientPrivacyStage(RoundStage):
    name = "privacy"
    order = ACCOUNT + 5
    setting = "model.privacy"

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.privacy)

    def __init__(self, privacy: ClientPrivacy) -> None:
        self.privacy = privacy

    def check(self, facts: RunFacts) -> None:
        participation = getattr(facts.data, "participation", None)
        self.privacy.prepare(participation, facts.data.num_clients, facts.rounds, facts.data.seed)

    def wants_stop(self) -> str | None:
        """privacy.budget="stop": one more round would spend more than target_epsilon."""
        if not self.privacy.budget_exhausted():
            return None
        return (
            f"privacy: stopping after {self.privacy.accountant.rounds} rounds: one more would spend more than "
            f"target_epsilon={self.privacy.target_epsilon:g}"
        )
