"""The round's divergence checks as stages (docs/algorithms.md, "Faults"): a client's non-finite training
loss or a mean loss grown by orders of magnitude (before the uploads are read), and a non-finite upload
(after a robust rule, which excludes such uploads as Byzantine, has had its turn)."""

from __future__ import annotations

import logging
import math
from typing import Any

from fl_lightning.reliability.faults import all_finite, first_non_finite
from fl_lightning.rounds.stage import ADMIT, CHECK, Round, RoundStage

log = logging.getLogger(__name__)
LOSS_GROWTH_WARNING = 100.0
"""A round's mean training loss this many times the first round's is reported (once per run)."""


class TrainingLossCheck(RoundStage):
    """A reporting client's infinite training loss stops the run; so does a mean loss more than
    ``faults.max_loss_growth`` times the first round's (beyond ``LOSS_GROWTH_WARNING``: one warning)."""

    name = "loss_check"
    order = ADMIT
    fusable = True

    def __init__(self, max_loss_growth: float | None) -> None:
        self.max_loss_growth = max_loss_growth
        self.first_loss: float | None = None
        self._reported = False

    def admit(self, round: Round) -> None:
        losses = round.results.mean_losses
        if any(map(math.isinf, losses)):  # any executor's: NaN may also mean "no loss recorded", infinity may not
            client, loss = next((c, loss) for c, loss in zip(round.results.client_ids, losses) if math.isinf(loss))
            raise round.diverged(f"round {round.plan.round}: client {client}'s training loss is non-finite ({loss})")
        self.check_growth(round.plan.round, losses, round.diverged)

    def check_growth(self, round_idx: int, losses: list[float], diverged: Any) -> None:
        """The mean of the finite losses against the first round's: ``diverged(message)`` past the limit."""
        finite = [loss for loss in losses if math.isfinite(loss)]
        if not finite:
            return
        loss = sum(finite) / len(finite)
        if self.first_loss is None:
            self.first_loss = loss
            return
        growth = loss / self.first_loss if self.first_loss > 0 else 0.0
        limit = self.max_loss_growth
        if limit is not None and growth > limit:
            raise diverged(
                f"round {round_idx}: the mean training loss {loss:.4g} is {growth:.3g}x the first round's ({self.first_loss:.4g}), "
                f"more than faults.max_loss_growth = {limit:g}"
            )
        if growth > LOSS_GROWTH_WARNING and not self._reported:
            self._reported = True
            log.warning(
                "round %d: the mean training loss %.4g is %.3gx the first round's (%.4g): the run is diverging; "
                "lower local.lr or the algorithm's global_lr (faults.max_loss_growth stops such a run)",
                round_idx, loss, growth, self.first_loss,
            )  # fmt: skip

    def checkpoint(self) -> dict[str, Any]:
        return {"first_loss": self.first_loss}

    def restore(self, saved: dict[str, Any]) -> None:
        self.first_loss = saved.get("first_loss")


ATTACKER_ADVICE = "it is a configured attacker (model.attack): add a robust rule (model.robust) to exclude such uploads"


class FiniteUploads(RoundStage):
    """A non-finite upload that reaches the aggregate stops the run, naming the client; a configured
    attacker's is named as such (a robust rule, ordered before this check, excludes them instead)."""

    name = "finite_uploads"
    order = CHECK
    fusable = True  # the compiled round reports each client's uploads finite or not (``round.summed.non_finite``)

    def admit(self, round: Round) -> None:
        if round.summed is not None:
            if round.summed.non_finite:
                raise round.diverged(f"round {round.plan.round}: client {round.summed.non_finite[0]} sent a non-finite update")
            return
        uploads = round.results.uploads
        if all_finite(uploads):
            return
        for client, upload in zip(round.results.client_ids, uploads):
            bad = first_non_finite(upload)
            if bad is not None:
                message = f"round {round.plan.round}: client {client} sent a non-finite update ({bad})"
                if round.malicious is not None and client in round.malicious:
                    raise round.diverged(message, advice=ATTACKER_ADVICE)
                raise round.diverged(message)
