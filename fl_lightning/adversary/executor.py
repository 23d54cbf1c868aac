"""The attack's place in a round: after every client trained, before the message pipeline's client stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fl_lightning.adversary.attack import Attack
from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.core.tasks import ClientResult, ClientTask, SummedRound
from fl_lightning.executors.base import ClientRuntime, Executor


class AttackExecutor(Executor):
    """Runs the wrapped executor, then lets ``attack`` replace the malicious clients' uploads of the round
    (``Attack.tamper``). Wrapped by ``MessageExecutor`` when message stages run, so compression, clipping
    and noise act on what the attacker sends, as on any upload."""

    def __init__(self, inner: Executor, attack: Attack) -> None:
        self.inner, self.attack = inner, attack

    def __getattr__(self, name: str) -> Any:
        """The wrapped executor's attributes (``fallbacks``, ``compile_seconds``) read through the wrapper."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> list[ClientResult]:
        return self.attack.tamper(self.inner.run(tasks, info, runtime), tasks, info, runtime.algorithm)

    def run_summed(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> SummedRound | None:
        return None  # one process: the module sums the (attacked) uploads
