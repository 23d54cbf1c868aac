"""Secure aggregation, with optional distributed DP, as a round stage (``model.secure_aggregation``; docs/privacy.md,
"Secure aggregation and distributed DP"; docs/algorithms.md, section 31): the clients' encoding and masking and the
server's unmasking are simulated on the uploads of the round (``fl_lightning/secagg``); what reaches the algorithm
is the decoded sum alone, as every arrived client's upload (each with equal weight), and the clients that dropped
after masking are dropped from the round."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from fl_lightning.algorithms.base import declares_capability
from fl_lightning.core.flat import unflatten
from fl_lightning.core.participation import derive_seed
from fl_lightning.core.tasks import Payload
from fl_lightning.pipeline.messages import SERVER_STREAM, sends_no_model_shaped_upload
from fl_lightning.reliability.fingerprint import describe_setting
from fl_lightning.rounds.stage import CHECK, Round, RoundStage, RunFacts
from fl_lightning.secagg import SecureAggregation, TooFewShares
from fl_lightning.secagg.accounting import DistributedAccountant
from fl_lightning.secagg.encoding import flatten

log = logging.getLogger(__name__)
SEES_ONE_UPLOAD = "it reads each client's upload, and under secure aggregation the server sees only the masked sum"


class SecureAggregationStage(RoundStage):
    name = "secure_aggregation"
    order = CHECK + 5  # after the finite checks, before the aggregate
    setting = "model.secure_aggregation"
    reads_each_upload = True  # the simulation encodes and masks each client's upload; the server's view is the sum
    conflicts: ClassVar[dict[str, str]] = {
        "robust": SEES_ONE_UPLOAD,
        "privacy": "client-level DP's noise is added by the server to the sum; use secure_aggregation.noise (distributed DP) instead",
        "lora_aggregation": f"a folding or heterogeneous-rank method: {SEES_ONE_UPLOAD}",
    }

    def __init__(self, secagg: SecureAggregation, asynchronous: bool = False) -> None:
        if asynchronous:
            raise ValueError("model.secure_aggregation runs in synchronous rounds (a masked sum over a cohort); remove model.asynchronous")
        self.secagg = secagg
        self.accountant = DistributedAccountant(secagg.delta) if secagg.noise is not None else None
        self._total: Tensor | None = None

    def describe(self) -> str | None:
        sa = self.secagg
        graph = "SecAgg" if sa.neighbours is None else f"SecAgg+ (k={sa.neighbours})"
        noise = "" if sa.noise is None else f", {'discrete Gaussian' if sa.noise == 'gaussian' else 'Skellam'} z={sa.noise_multiplier:g}"
        late = f", {sa.dropout_after_masking:.0%} drop after masking" if sa.dropout_after_masking else ""
        return f"{graph}, {sa.bits} bits, clip {sa.clip:g}{noise}{late}"

    def fingerprint(self) -> dict[str, str]:
        return {"secure_aggregation": describe_setting(self.secagg)}

    def conflict_with(self, other: RoundStage) -> str | None:
        if other.name == "privacy":
            return f"model.secure_aggregation with model.privacy: {self.conflicts['privacy']}"
        if other.reads_each_upload and other.name != self.name:
            return f"{other.setting} with model.secure_aggregation: {SEES_ONE_UPLOAD}"
        return None

    def check(self, facts: RunFacts) -> None:
        name = type(facts.algorithm).__name__
        if not declares_capability(facts.algorithm, "linear_aggregate"):
            raise ValueError(
                f"model.secure_aggregation: {name} cannot be securely aggregated: its aggregate is not declared a weighted sum of "
                "the uploads (linear_aggregate), and the server sees only their sum"
            )
        if getattr(facts.algorithm, "warmup_pass", False):
            raise ValueError(f"model.secure_aggregation: {name}'s warm-up pass sends every client's state outside the secure sum")
        if sends_no_model_shaped_upload(facts.algorithm):
            raise ValueError(f"model.secure_aggregation: {name}'s uploads are not shaped like the model (its upload_entries is empty)")
        if facts.cohort is not None:
            self.secagg.check_cohort(facts.cohort)

    def aggregation_weights(self, round: Round):
        """Equal weights: 1 / (arrived clients), or under distributed DP the fixed 1 / (clients of the plan)."""
        planned = len(round.plan.clients)

        def weights(ids) -> Tensor:
            return torch.full((len(ids),), 1.0 / (planned if self.secagg.noise is not None else len(ids)), dtype=torch.float64)

        return weights

    def admit(self, round: Round) -> None:
        """The protocol's round on the uploads that came back; the clients that dropped after masking leave the round."""
        results, plan = round.results, round.plan
        self.secagg.check_cohort(len(plan.clients))  # a cohort not known before training (Bernoulli participation)
        position = {cid: p for p, cid in enumerate(plan.clients.tolist())}
        trained = [position[cid] for cid in results.client_ids]
        self._like = results.uploads[0]
        vectors = torch.stack([flatten(upload) for upload in results.uploads])
        server_seed = derive_seed(round.seed, plan.round, SERVER_STREAM)
        try:
            out = self.secagg.run(vectors, trained, [int(s) for s in plan.seeds.tolist()], server_seed)
        except TooFewShares as error:  # the protocol aborts the round: nothing is revealed
            round.metrics["secagg/aborted"] = 1.0
            round.skip(f"secure_aggregation: round {plan.round} aborted: {error}; lower dropout_after_masking or threshold")
            return
        round.metrics.update(out.metrics)
        if out.metrics["secagg/overflow"]:
            log.warning("round %d: secure_aggregation: %d summed coordinates wrapped modulo 2^%d; raise bits or k_stddevs",
                        plan.round, int(out.metrics["secagg/overflow"]), self.secagg.bits)  # fmt: skip
        if self.accountant is not None and out.arrived:
            self.accountant.step(out.rdp)
        late = [cid for cid in results.client_ids if position[cid] not in out.arrived]
        if late:
            log.warning("round %d: clients %s dropped after masking (their masks recovered from shares)", plan.round, late)
            round.exclude(late)
        if not out.arrived:
            round.skip("secure_aggregation: no masked vector arrived")
            return
        self._total = out.total

    def combine(self, round: Round, weights: Tensor) -> Payload:
        """The decoded sum S over the n arrived clients as each one's upload: the algorithm's ``upload_sum`` of n copies
        of S / n at equal weights, which any linear aggregate turns into its value at the clients' own uploads."""
        n = len(round.results)
        mean = unflatten(self._total / n, self._like)
        return round.algorithm.upload_sum(round.x, [mean] * n, weights, round.info)

    def finish(self, round: Round, reporting: int) -> None:
        if self.accountant is not None:
            round.metrics["privacy/epsilon"] = self.accountant.epsilon()
            round.metrics["privacy/noise_multiplier"] = self.secagg.noise_multiplier

    def checkpoint(self) -> dict[str, Any]:
        if self.accountant is None:
            return {}
        return {"secure_aggregation": {"rounds": torch.tensor(self.accountant.rounds), "rdp": torch.from_numpy(self.accountant.rdp.copy())}}

    def restore(self, saved: dict[str, Any]) -> None:
        state = saved.get("secure_aggregation")
        if self.accountant is not None and state:
            self.accountant.rounds, self.accountant.rdp = int(state["rounds"]), np.asarray(state["rdp"].numpy(), dtype=np.float64)
