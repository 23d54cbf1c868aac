"""A LoRA aggregation method as a round stage (``model.lora_aggregation``; docs/algorithms.md, section 28):
each client's broadcast and upload at its rank, and after the server step the method's new factors and
fold (``fl_lightning/lora/server.py``)."""

from __future__ import annotations


from fl_lightning.core import params as P
from fl_lightning.lora.server import LoRAServer
from fl_lightning.reliability.faults import survivor_weights
from fl_lightning.rounds.stage import SHAPE, Cohort, Round, RoundStage


class LoRAStage(RoundStage):
    name = "lora_aggregation"
    order = SHAPE + 8  # after the faults and the deadline: the own broadcasts of the clients that run
    setting = "model.lora_aggregation"
    reads_each_upload = "by method"  # each instance: its method's (folding or heterogeneous ranks read every client)
    conflicts = {"privacy": "a folding method (stacked, exact_residual, svd, zero_pad) computes from each client's un-noised factors"}

    def __init__(self, server: LoRAServer) -> None:
        self.server = server
        self.reads_each_upload = server.reads_clients
        self._x_round = None

    def conflict_with(self, other: RoundStage) -> str | None:
        if other.name == "privacy" and not self.server.method.private:
            name = self.server.method.name
            return (
                f"model.lora_aggregation={name} with client-level DP (model.privacy): clipping and noise bound the sum of the factor "
                f"deltas, but {name} computes from each client's un-noised factors (products, SVD or norms), so no DP guarantee "
                "holds; use model.lora_aggregation factors or share_a (or the model's freeze_a) with privacy"
            )
        return None

    def on_broadcast(self, round: Round) -> None:
        if self.server.method.needs_clients:  # the factors the clients start from (after downlink stages)
            self._x_round = P.detach_clone(round.broadcast["x"])

    def shape_cohort(self, round: Round | None, cohort: Cohort) -> None:
        """A client of a lower rank gets the broadcast zero-padded to its rank."""
        server = self.server
        own = {i: server.client_broadcast(cohort.broadcast, cid) for i, cid in enumerate(cohort.client_ids) if server.client_rank(cid) < server.rank}
        cohort.own_broadcasts.update(own)

    def admit(self, round: Round) -> None:
        if self.server.heterogeneous:  # a rank-r_i client sends its factors' first r_i components
            for result in round.results:
                result.upload = self.server.mask_upload(result.upload, result.client_id)

    def after_step(self, round: Round) -> None:
        if not self.server.method.needs_clients:
            return
        results, plan = round.results, round.plan
        ids = results.client_ids
        weights = survivor_weights(plan.clients, plan.weights, ids)
        deltas = list(P.part(results.uploads, "delta"))
        fold = self.server.finish_round(self._x_round, deltas, ids, weights, round.seed, plan.round)
        round.metrics["comm/round_bytes_fold"] = fold
        round.extra_bytes_down = fold

    def describe(self) -> str | None:
        return self.server.describe() or self.server.method.name

    def fingerprint(self) -> dict[str, str]:
        described = self.server.describe()
        return {} if described is None else {"lora_aggregation": described}
