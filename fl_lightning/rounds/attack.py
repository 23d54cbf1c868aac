"""Malicious clients as a round stage (``model.attack``; docs/robustness.md, "Attacks"): the malicious set
drawn before training, their poisoned data for local training, their uploads replaced around the executor
(inside the message stages: compression, clipping and noise see what the attacker sends), the round's
attack metrics, and the attackers' ids for the stages after it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fl_lightning.adversary import Attack
from fl_lightning.adversary.executor import AttackExecutor
from fl_lightning.reliability.fingerprint import describe_setting
from fl_lightning.rounds.stage import ATTACK, Round, RoundStage, RunFacts


MALICIOUS_FILE = "malicious_clients.csv"
"""The run's malicious client ids (one per row), in the run's folder."""


class AttackStage(RoundStage):
    name = "attack"
    order = ATTACK
    setting = "model.attack"
    conflicts = {"record_privacy": "a data poisoning (attack.data) cannot poison DP-SGD's sampled records"}

    def describe(self) -> str | None:
        from fl_lightning.reliability.fingerprint import describe_setting

        return describe_setting(self.attack)

    def __init__(self, attack: Attack) -> None:
        self.attack = attack

    def conflict_with(self, other: RoundStage) -> str | None:
        if other.name == "record_privacy" and self.attack.data is not None:
            return "attack.data cannot poison record-level DP-SGD's sampled records (record_privacy); use one or the other"
        return None

    def check(self, facts: RunFacts) -> None:
        """The refusals, then the malicious set drawn from data.seed."""
        data = facts.data
        self.attack.prepare(data.num_clients, data.seed, getattr(data, "num_classes", None), facts.algorithm,
                            facts.processes, "record_privacy" in facts.stages)  # fmt: skip
        self.attack.check_data(data)
        if facts.rank == 0 and facts.run_dir:  # who attacked, beside the metrics (robust/detection_* are scored against it)
            os.makedirs(facts.run_dir, exist_ok=True)
            with open(os.path.join(facts.run_dir, MALICIOUS_FILE), "w") as file:
                file.write("client\n" + "".join(f"{c}\n" for c in self.attack.malicious.ids))

    def wrap_executor(self, executor: Any) -> Any:
        return AttackExecutor(executor, self.attack)

    def local_training(self, runtime: Any, private: bool) -> Any:
        return dataclasses.replace(runtime, data=self.attack.data_view(runtime.data))

    def on_results(self, round: Round) -> None:
        round.malicious = frozenset(self.attack.malicious.ids)
        round.metrics.update(self.attack.round_metrics())

    def fingerprint(self) -> dict[str, str]:
        return {"attack": describe_setting(self.attack)}
