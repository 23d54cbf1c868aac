"""``--model.execution auto``: the run's executor chosen from a measurement of its first rounds
(docs/performance.md, "Choosing an execution").

Batched execution is not always the faster one: on a CPU a stacked CNN round can be slower than running its
clients one after another, and compiled programs pay off only where their rounds repeat. ``AutoExecutor`` runs
the first rounds under each candidate in turn, ``rounds_each`` rounds apiece (the first of them a warm-up that
may compile), times the last round of each per client-step, and runs the rest of the run under the fastest.

The trial rounds are part of the run: a run with ``choice`` set runs the same schedule without timing it and then
the chosen executor, so it reproduces the measuring run bitwise. The choice is logged once, kept in the
checkpoint (a resume after the trial never measures again), and written into the run's ``config.yaml`` as
``choice``, so that ``fit --config <run>/config.yaml`` reruns it exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.core.tasks import ClientResult, ClientTask, SummedRound
from fl_lightning.executors.base import ClientRuntime, Executor

log = logging.getLogger(__name__)

CANDIDATES = ("sequential", "batched")
"""The executions ``auto`` tries by default. The compiled ones (``sequential_compiled``, ``batched_compiled``) are
opt-in: their trial round compiles (10-60 s on a CPU), which a run must be long enough to win back."""


def _executors() -> dict[str, Any]:
    from fl_lightning.executors.batched import BatchedExecutor
    from fl_lightning.executors.sequential import SequentialExecutor

    return {"sequential": SequentialExecutor, "batched": BatchedExecutor, "sequential_compiled": lambda: SequentialExecutor(compile=True),
            "batched_compiled": lambda: BatchedExecutor(compile=True),
            "batched_compiled_round": lambda: BatchedExecutor(compile=True, compile_round=True)}  # fmt: skip


class AutoExecutor(Executor):
    """Runs the first ``rounds_each * len(candidates)`` rounds under each candidate in turn, then the fastest.

    Args:
        candidates: executions to try, in this order, from ``sequential``, ``batched``, ``sequential_compiled``,
            ``batched_compiled``, ``batched_compiled_round`` (the compiled round).
        rounds_each: trial rounds per candidate (>= 2): the first is a warm-up (compilation), the last is timed.
        choice: the execution to run after the trial rounds without measuring (one of ``candidates``);
            ``None``: measure. The measuring run writes its choice into the run's ``config.yaml``.
    """

    def __init__(self, candidates: Sequence[str] = CANDIDATES, rounds_each: int = 2, choice: str | None = None) -> None:
        builders = _executors()
        known, candidates = tuple(builders), list(candidates)
        if not candidates or any(c not in known for c in candidates) or len(set(candidates)) < len(candidates):
            raise ValueError(f"execution.candidates must be distinct names from {', '.join(known)}, got {candidates}")
        if type(rounds_each) is not int or rounds_each < 2:
            raise ValueError(f"execution.rounds_each must be an integer >= 2 (a warm-up round, then a timed one), got {rounds_each!r}")
        if choice is not None and choice not in candidates:
            raise ValueError(f"execution.choice must be one of the candidates {candidates} or null, got {choice!r}")
        self.candidates, self.rounds_each, self.choice = candidates, rounds_each, choice
        self.executors = {name: builders[name]() for name in candidates}
        self.seconds_per_step: dict[str, float] = {}  # the timed round of each candidate: seconds per client-step
        self._rounds = 0  # rounds run by this executor (restored on resume)

    @property
    def trial_rounds(self) -> int:
        return self.rounds_each * len(self.candidates)

    def _current(self) -> tuple[str, bool]:
        """The execution of the next round, and whether that round is timed."""
        if self._rounds < self.trial_rounds:
            index, within = divmod(self._rounds, self.rounds_each)
            return self.candidates[index], self.choice is None and within == self.rounds_each - 1
        return self.choice, False

    def _decide(self) -> None:
        """After the last trial round: the fastest candidate per client-step, logged once."""
        self.choice = min(self.candidates, key=lambda c: self.seconds_per_step.get(c, float("inf")))
        measured = ", ".join(f"{c} {1e3 * s:.3f}" for c, s in self.seconds_per_step.items())
        log.warning(f"execution auto: {self.choice} (ms per client-step in its timed trial round: {measured}); rerun it with "
                    f"--model.execution.init_args.choice {self.choice} (written into the run's config.yaml)")  # fmt: skip

    def _timed(self, method: str, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> Any:
        name, timed = self._current()
        if any(t.warmup for t in tasks):  # the algorithm's pass over every client before round 0 is no round
            return getattr(self.executors[name], method)(tasks, info, runtime)
        start = time.perf_counter()
        out = getattr(self.executors[name], method)(tasks, info, runtime)
        if out is None:  # run_summed that this executor leaves to run: the same round follows through run
            return None
        if timed:
            steps = sum(t.num_steps for t in tasks)
            self.seconds_per_step[name] = (time.perf_counter() - start) / max(steps, 1)
        self._rounds += 1
        if self.choice is None and self._rounds == self.trial_rounds:
            self._decide()
        return out

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> Sequence[ClientResult]:
        return self._timed("run", tasks, info, runtime)

    def run_summed(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> SummedRound | None:
        return self._timed("run_summed", tasks, info, runtime)

    # ---- what the run checks, reports and keeps ------------------------------------------------------
    def check(self, facts: Any) -> None:
        if facts.processes > 1 and self.choice is None:  # each process would time its own clients and could choose differently
            raise ValueError(
                f"model.execution=auto measures on one process; with {facts.processes} (DDP) set execution.choice "
                f"(one of {', '.join(self.candidates)}) or the execution itself"
            )

    @property
    def active(self) -> Executor:
        return self.executors[self._current()[0]]

    @property
    def fallbacks(self):
        return getattr(self.active, "fallbacks", {})

    @property
    def stats(self) -> dict[str, int]:
        return getattr(self.active, "stats", {})

    @property
    def compile_seconds(self) -> float | None:
        seconds = [s for s in (getattr(e, "compile_seconds", None) for e in self.executors.values()) if s is not None]
        return sum(seconds) if seconds else None

    def describe(self) -> str | None:
        if self.choice is None:
            return f"execution auto (measuring: {self._rounds} of {self.trial_rounds} trial rounds run)"
        return f"execution auto: {self.choice}"

    def recorded_setting(self) -> dict | None:
        """``model.execution`` as the run's config records it: this executor with its choice (None before it)."""
        if self.choice is None:
            return None
        init = {"candidates": list(self.candidates), "rounds_each": self.rounds_each, "choice": self.choice}
        return {"class_path": f"{type(self).__module__}.{type(self).__name__}", "init_args": init}

    def checkpoint(self) -> dict:
        return {"auto_execution": {"rounds": self._rounds, "choice": self.choice, "seconds_per_step": dict(self.seconds_per_step)}}

    def restore(self, state: dict) -> None:
        saved = state.get("auto_execution")
        if saved is None:
            return
        self._rounds, self.seconds_per_step = int(saved["rounds"]), dict(saved["seconds_per_step"])
        if self.choice is None:
            self.choice = saved["choice"]
