"""Client-level DP without sampling as the ``privacy`` round stage (``model.privacy: CorrelatedNoise``;
docs/privacy.md, "Without sampling"): the schedule refused or accepted and the mechanism's matrix and
sensitivities computed before training, the fixed weight 1/D, the round's correlated noise added to the
clipped sum (32.1), ``privacy/epsilon`` after each round (32.8), the noise's state in the checkpoint.
The clip is a message stage (``ClipStage``), run by the ``messages`` stage."""

from __future__ import annotations

from typing import Any

import torch

from fl_lightning.core.flat import unflatten
from fl_lightning.pipeline.correlated_noise import CorrelatedNoise
from fl_lightning.pipeline.matrix_factorization import BandedNoise, TreeNoise
from fl_lightning.pipeline.messages import add_sums, upload_like
from fl_lightning.pipeline.privacy import GaussianSumNoise
from fl_lightning.rounds.client_privacy import ClientPrivacyStage
from fl_lightning.rounds.stage import Round, RunFacts

CHECKPOINT_KEY = "correlated_noise"


class CorrelatedNoiseStage(ClientPrivacyStage):
    """The ``privacy`` stage (its name, place and declared conflicts) under a ``CorrelatedNoise`` setting."""

    adds_to_sum = True

    def __init__(self, privacy: CorrelatedNoise) -> None:
        super().__init__(privacy)
        self.noise: TreeNoise | BandedNoise | None = None
        self.rounds_done = 0  # rounds whose noise was drawn (the release covers them)
        self._saved: dict[str, torch.Tensor] | None = None

    def check(self, facts: RunFacts) -> None:
        GaussianSumNoise(self.privacy).check(facts.algorithm, facts.data.num_clients)
        self.privacy.prepare(getattr(facts.data, "participation", None), facts.data.num_clients, facts.rounds)
        self.seed = facts.data.seed
        saved = (self._saved or {}).get("coefficients")
        if saved is not None and (self.privacy.coefficients is None or not torch.equal(saved, self.privacy.coefficients)):
            raise ValueError(
                "privacy: the checkpoint's banded matrix was computed for other settings (trainer.max_steps, privacy.bands or "
                "mechanism); resume with the settings the run was started with"
            )

    def wants_stop(self) -> str | None:
        return None

    def aggregation_weights(self, round: Round):
        """1/D for each reporting client, D the round's scheduled cohort (public: the schedule is fixed)."""
        weight = 1.0 / len(round.plan.clients)
        return lambda reporting: torch.full((len(reporting),), weight, dtype=torch.float64)

    def add_to_sum(self, round: Round, sums):
        """The clipped sum plus sigma C w_t, as the algorithm's ``upload_sum`` of one pseudo-upload of weight 1/D."""
        like, w = self._draw(round)
        w = w * (self.privacy.noise_multiplier * self.privacy.current_clip)
        extra = unflatten(w, like)
        weight = 1.0 / len(round.plan.clients)
        return add_sums(sums, round.algorithm.upload_sum(round.x, [extra], [weight], round.info))

    def finish(self, round: Round, reporting: int) -> None:
        if self.rounds_done <= round.plan.round:  # an empty round: its noise is drawn (and dropped) all the same
            self._draw(round)
        epsilon = self.privacy.epsilon(self.rounds_done)
        round.metrics.update({"privacy/epsilon": epsilon, "privacy/noise_multiplier": self.privacy.noise_multiplier,
                              "privacy/sensitivity": float(self.privacy.sensitivity[self.rounds_done - 1])})  # fmt: skip

    def _draw(self, round: Round) -> tuple[Any, torch.Tensor]:
        """The round's unscaled noise vector, one value per element of an upload (``like``: its entries and shapes)."""
        like = upload_like(round.algorithm, round.x)
        return like, self._next(sum(t.numel() for td in like.values() for t in td.values()), round.plan.round)

    def _next(self, size: int, round_idx: int) -> torch.Tensor:
        if self.noise is None:
            self.noise = self.privacy.noise(self.seed, size)
            if self._saved is not None:
                self.noise.load_state_dict(self._saved)
        self.rounds_done = round_idx + 1
        return self.noise.next()

    def checkpoint(self) -> dict[str, Any]:
        state = self.noise.state_dict() if self.noise is not None else {}
        if self.privacy.coefficients is not None:
            state["coefficients"] = self.privacy.coefficients.clone()
        return {CHECKPOINT_KEY: state}

    def restore(self, saved: dict[str, Any]) -> None:
        state = saved.get(CHECKPOINT_KEY)
        if not state or "rounds" not in state:
            return
        self._saved, self.rounds_done, self.noise = dict(state), int(state["rounds"]), None
