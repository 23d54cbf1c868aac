"""The message pipeline's server side as a round stage: the broadcast's downlink stages, the aggregate
stage's fixed weights and extra upload, the stages' round metrics and state (``fl_lightning.pipeline.messages``).
Its client stages run around the executor (``MessageExecutor``)."""

from __future__ import annotations

from typing import Any

from fl_lightning.pipeline.messages import MessageExecutor, MessagePipeline, add_sums, upload_like
from fl_lightning.rounds.stage import BROADCAST, Round, RoundStage, RunFacts


class MessageStages(RoundStage):
    """``pipeline`` (not empty) in the round; ``algorithm``: the run's (its upload's structure)."""

    name = "messages"
    order = BROADCAST
    setting = "model.uplink/downlink"

    def __init__(self, pipeline: MessagePipeline, algorithm: Any) -> None:
        self.pipeline, self.algorithm = pipeline, algorithm
        self.adds_to_sum = pipeline.aggregate is not None

    def check(self, facts: RunFacts) -> None:
        self.pipeline.check(facts.algorithm, facts.data.num_clients)

    def wrap_executor(self, executor: Any) -> Any:
        return MessageExecutor(executor, self.pipeline) if self.pipeline.client_stages else executor

    def on_broadcast(self, round: Round) -> None:
        self.pipeline.begin_round(round.info)
        if self.pipeline.broadcast_stages:
            round.broadcast, round.broadcast_bytes = self.pipeline.transform_broadcast(round.broadcast, round.info, round.seed)

    def aggregation_weights(self, round: Round):
        return self.pipeline.aggregation_weights(round.info)

    def add_to_sum(self, round: Round, sums):
        """The uploads' sums plus the aggregate stage's extra upload (e.g. privacy's noise), drawn once on the
        server from (seed, round): the same for every executor and on every process."""
        if not self.adds_to_sum:
            return sums
        like = upload_like(self.algorithm, round.x)
        return add_sums(sums, self.pipeline.extra_sum(self.algorithm, round.x, like, round.info, round.seed))

    def finish(self, round: Round, reporting: int) -> None:
        round.metrics.update(self.pipeline.end_round(round.info, reporting))

    def checkpoint(self) -> dict[str, Any]:
        return {"messages": self.pipeline.state_dict()}

    def restore(self, saved: dict[str, Any]) -> None:
        self.pipeline.load_state_dict(saved.get("messages", {}))

