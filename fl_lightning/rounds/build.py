"""The round of a run, built from its settings: the chain of stages (in the order they declare), the
message pipeline they share and the driver that runs them (synchronous, or asynchronous under
``model.asynchronous``). The one place that knows every shipped mechanism; the round itself never asks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fl_lightning.pipeline.messages import MessagePipeline
from fl_lightning.rounds.asynchronous import AsynchronousRounds
from fl_lightning.rounds.composition import check_composition
from fl_lightning.rounds.driver import SynchronousRounds
from fl_lightning.rounds.finite import FiniteUploads, TrainingLossCheck
from fl_lightning.rounds.faults import FaultsStage
from fl_lightning.rounds.stage import RoundStage


@dataclass
class RoundSettings:
    """The module's settings a round is built from (``FederatedModule``'s arguments of the same names)."""

    model: Any
    algorithm: Any
    federated_names: Sequence[str]
    personal_names: Sequence[str]
    local: Any
    faults: Any
    uplink: Sequence[Any] = ()
    downlink: Sequence[Any] = ()
    privacy: Any = None
    compression: Any = None
    record_privacy: Any = None
    clock: Any = None
    asynchronous: Any = None
    robust: Any = None
    attack: Any = None
    lora_aggregation: Any = None
    secure_aggregation: Any = None
    stages: Sequence[RoundStage] = ()


@dataclass
class BuiltRound:
    driver: SynchronousRounds | AsynchronousRounds
    messages: MessagePipeline
    lora: Any
    time: Any


def build_round(s: RoundSettings) -> BuiltRound:
    """The stages of ``s`` and their driver; the refusals of each mechanism and of their composition."""
    from fl_lightning.lora.server import lora_server

    stages: list[RoundStage] = [FaultsStage(s.faults), FiniteUploads()]
    losses = TrainingLossCheck(s.faults.max_loss_growth)
    stages.append(losses)
    compress_up, compress_down = s.compression.stages() if s.compression is not None else ([], [])
    if s.compression is not None:
        from fl_lightning.rounds.compression import CompressionStage

        named = dict(s.model.named_parameters())
        stages.append(CompressionStage(s.compression, {n: named[n].shape for n in s.federated_names}))
    privacy_stages = s.privacy.stages() if s.privacy is not None else []
    messages = MessagePipeline([*s.uplink, *privacy_stages, *compress_up], [*s.downlink, *compress_down])
    if messages:
        from fl_lightning.rounds.messages import MessageStages

        stages.append(MessageStages(messages, s.algorithm))
    if s.asynchronous is not None:
        s.asynchronous.check(s.algorithm, s.clock, s.privacy, s.record_privacy, messages, s.personal_names, s.faults)
    lora = lora_server(s.lora_aggregation, s.model, s.federated_names, s.personal_names, s.algorithm)
    if lora is not None:
        from fl_lightning.rounds.lora import LoRAStage

        stages.append(LoRAStage(lora))
    time = None
    if s.clock is not None:
        from fl_lightning.rounds.clock import ClockStage, SimulatedTime

        time = SimulatedTime(s.clock, s.algorithm, s.compression)
        if s.asynchronous is None:
            stages.append(ClockStage(time))
    stages += _optional_stages(s)
    stages += list(s.stages)
    check_composition(stages)
    if s.asynchronous is not None:
        return BuiltRound(AsynchronousRounds(stages, s.asynchronous, time, s.faults, losses), messages, lora, time)
    return BuiltRound(SynchronousRounds(stages), messages, lora, time)


def _optional_stages(s: RoundSettings) -> list[RoundStage]:
    stages: list[RoundStage] = []
    if s.robust is not None:
        from fl_lightning.rounds.robust import RobustStage

        stages.append(RobustStage(s.robust))
    if s.attack is not None:
        from fl_lightning.rounds.attack import AttackStage

        stages.append(AttackStage(s.attack))
    if s.privacy is not None:
        from fl_lightning.pipeline.correlated_noise import CorrelatedNoise
        from fl_lightning.rounds.client_privacy import ClientPrivacyStage
        from fl_lightning.rounds.correlated_noise import CorrelatedNoiseStage

        stages.append((CorrelatedNoiseStage if isinstance(s.privacy, CorrelatedNoise) else ClientPrivacyStage)(s.privacy))
    if s.secure_aggregation is not None:
        from fl_lightning.rounds.secure_aggregation import SecureAggregationStage

        stages.append(SecureAggregationStage(s.secure_aggregation, asynchronous=s.asynchronous is not None))
    if s.record_privacy is not None:
        from fl_lightning.rounds.record_privacy import RecordPrivacyStage

        stages.append(RecordPrivacyStage(s.record_privacy, s.model))
    return stages


def shipped_stages() -> tuple[list[type[RoundStage]], list[type]]:
    """Every shipped stage class and the drivers, for the docs' composition table (``composition_table``)."""
    from fl_lightning.rounds.attack import AttackStage
    from fl_lightning.rounds.client_privacy import ClientPrivacyStage
    from fl_lightning.rounds.clock import ClockStage
    from fl_lightning.rounds.compression import CompressionStage
    from fl_lightning.rounds.lora import LoRAStage
    from fl_lightning.rounds.messages import MessageStages
    from fl_lightning.rounds.record_privacy import RecordPrivacyStage
    from fl_lightning.rounds.robust import RobustStage
    from fl_lightning.rounds.secure_aggregation import SecureAggregationStage

    stages = [MessageStages, FaultsStage, ClockStage, LoRAStage, AttackStage, RecordPrivacyStage, ClientPrivacyStage, TrainingLossCheck,
              RobustStage, FiniteUploads, SecureAggregationStage, CompressionStage]  # fmt: skip
    return stages, [AsynchronousRounds]
