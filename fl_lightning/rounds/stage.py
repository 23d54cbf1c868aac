"""The round-stage contract: the server side of a synchronous round as a chain of stages
(docs/architecture.md, "Round stages").

A round runs its hooks in this order; every stage of the chain is called at each hook, in the order
of the stages' ``order`` (smaller first, stable for equal orders), and implements only the hooks it
needs (the base class's do nothing):

1. ``on_broadcast``: the broadcast is computed; transform it, time the round (clock), keep a copy.
2. ``shape_cohort``: drop clients or cut their local steps (faults, deadlines), give some clients
   their own broadcast (LoRA ranks).
   -- the executor trains the cohort --
3. ``on_results``: bookkeeping on what came back, run even when no client reported (accounting,
   failure limits, the clock's end of round, metrics).
4. ``admit``: validate, filter or reweight the uploads before aggregation (non-finite checks, a robust
   rule's exclusions and its minimum of clients); ``round.skip(reason)`` aggregates nothing.
5. ``aggregation_weights`` / ``combine`` / ``add_to_sum``: the aggregate. One stage may ``combine``
   the uploads into their sum (a robust rule); stages may add to the sum (privacy's noise).
6. ``finish``: after the aggregate (or an empty round): metrics of the round (an accountant's epsilon).
7. ``after_step``: after the server optimizer's step (LoRA's fold, the global model's finite check).

``check`` runs once before training (``RunFacts``), ``checkpoint``/``restore`` carry the stage's state
in the checkpoint, ``wrap_executor`` puts a client-side part (an attack on uploads, message stages)
around the executor (a stage earlier in the round wraps outside a later one: the message stages see
what the attack sent), ``local_training`` gives local training its part of the stage (poisoned batches, DP-SGD), ``wants_stop``
ends the run before a round (a spent privacy budget), ``fingerprint`` names what a resume must match. Composition is declared, not coded: ``conflicts`` names the stages a stage cannot
run beside and why, ``reads_each_upload`` says it needs every upload in one place (so the round cannot
be summed across processes); ``fl_lightning.rounds.composition`` checks both once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.core.participation import RoundPlan
from fl_lightning.core.params import TensorDict
from fl_lightning.core.round_results import RoundResults
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import Payload, RoundTasks, SummedRound
from fl_lightning.reliability.faults import DivergenceError

BROADCAST, SHAPE, ATTACK, ACCOUNT, ADMIT, FILTER, CHECK, AGGREGATE, NOISE, AFTER = 10, 20, 30, 40, 50, 60, 70, 80, 90, 100
"""``RoundStage.order`` landmarks; a stage picks one (or a value between) for where it runs in every hook."""


@dataclass
class Cohort:
    """The clients a round dispatches, as columns being shaped: ids, round seeds, full K_i and the steps
    each may run (``budgets``); the broadcast they share, ``own_broadcasts`` by position; ``warmup``: the
    warm-up pass (no faults, no deadline)."""

    client_ids: list[int]
    seeds: list[int]
    full_steps: list[int]
    budgets: list[int]
    broadcast: Payload
    warmup: bool = False
    own_broadcasts: dict[int, Payload] = field(default_factory=dict)

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only the clients at ``positions`` (in order)."""
        for name in ("client_ids", "seeds", "full_steps", "budgets"):
            column = getattr(self, name)
            setattr(self, name, [column[p] for p in positions])


@dataclass
class Round:
    """One synchronous round as the stages see it. ``metrics`` collects what the round logs beside the
    engine's own; ``malicious`` holds the configured attackers' ids (an attack stage sets them)."""

    plan: RoundPlan
    info: RoundInfo
    x: TensorDict
    server_state: NestedState
    broadcast: Payload
    seed: int
    num_clients: int
    algorithm: Any = None
    broadcast_bytes: int | None = None
    tasks: RoundTasks | None = None
    results: RoundResults | None = None
    summed: SummedRound | None = None
    weights: Callable[[Sequence[int]], Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    malicious: frozenset[int] | None = None
    skipped: str | None = None
    full_steps: list[int] | None = None
    """Each planned client's full local steps K_i (in plan order), computed once by the driver before ``on_broadcast``."""
    extra_bytes_down: int = 0
    """Bytes each client receives besides the broadcast (a folding LoRA method's changed frozen weights): counted
    in ``comm/round_bytes_down`` and the cumulative bytes, for as many clients as reported this round."""
    diverged: Callable[..., Exception] = DivergenceError
    """``diverged(message, advice=...)``: the error that stops a diverged run (the engine's names the last good checkpoint)."""

    def skip(self, reason: str) -> None:
        """Aggregate nothing this round (x, the server state and the client store stay as they are)."""
        self.skipped = reason

    def exclude(self, client_ids: Sequence[int]) -> None:
        """Drop these clients' results before aggregation (their state is not kept)."""
        drop = set(client_ids)
        keep = [i for i, cid in enumerate(self.results.client_ids) if cid not in drop]
        self.results = RoundResults.of([self.results[i] for i in keep])


@dataclass(frozen=True)
class RunFacts:
    """What ``check`` may read before training: the algorithm, the client data (``ClientData``), the
    clients a round selects where fixed, the processes, the rounds, the run's folder, this process's rank,
    the personal tensors' names, the stages of the chain (by name), the local training settings and the
    engine's ``runtime`` (a ``ClientRuntime`` for training done by the server, e.g. FLTrust's root update)."""

    algorithm: Any
    data: Any
    cohort: int | None
    processes: int
    rounds: int
    run_dir: str | None
    resumed_round: int
    rank: int
    personal_names: tuple[str, ...]
    stages: tuple[str, ...]
    local: Any
    runtime: Callable[..., Any]


def refusal(check: Callable[[], None]) -> str | None:
    """The one-line ``ValueError`` a mechanism's own ``check()`` raises, as a declared conflict's reason (None: none)."""
    try:
        check()
    except ValueError as error:
        return str(error)
    return None


class RoundStage:
    """One server-side mechanism of a round. Subclasses set ``name`` (unique in a chain) and ``order``,
    and implement the hooks they need (module docstring)."""

    name: ClassVar[str] = "stage"
    order: ClassVar[int] = AFTER
    setting: ClassVar[str] = ""
    """The setting that configures the stage (``model.robust``), for one-line refusals."""
    conflicts: ClassVar[dict[str, str]] = {}
    """Other stages' names this one cannot run beside (or, where ``conflict_with`` narrows it, under which of
    its settings), each with the reason; the docs' composition table is generated from it."""
    reads_each_upload: ClassVar[bool] = False
    """Whether the stage needs every upload of the round in one place (no sums across processes)."""
    fusable: ClassVar[bool] = False
    """Whether the compiled round (the clients, the aggregate and the server step as one program, docs/performance.md)
    may run with this stage in the chain: the stage reads only the round's results as columns and its summed facts
    (``round.summed``), and changes neither the cohort's work, the uploads, the weights nor the sum."""

    def local_training(self, runtime: Any, private: bool) -> Any:
        """What local training uses (a ``ClientRuntime``), with this stage's part: an attack's poisoned
        batches, record-level DP-SGD where ``private`` (default: unchanged)."""
        return runtime

    def fingerprint(self) -> dict[str, str]:
        """What a resume must match of this stage's settings (``fl_lightning/reliability/fingerprint.py``)."""
        return {}

    def describe(self) -> str | None:
        """The mechanism and its settings in a few words for the run's result line and compare's run list
        (None: nothing to name, e.g. the divergence checks); default: the configuring setting's object, described."""
        return None

    def wants_stop(self) -> str | None:
        """Why the run must stop before another round (None: it may go on; a spent privacy budget)."""
        return None

    def conflict_with(self, other: RoundStage) -> str | None:
        """Why this stage cannot run beside ``other`` with the settings at hand (None: it can); default: the
        declared ``conflicts``. A stage whose refusal depends on its settings overrides it."""
        return self.conflicts.get(other.name)

    def check(self, facts: RunFacts) -> None:
        """Refuse, in one line naming the setting, a run this stage cannot serve; before any training."""

    def wrap_executor(self, executor: Any) -> Any:
        """The executor with this stage's client-side part around it (default: unchanged)."""
        return executor

    def on_broadcast(self, round: Round) -> None: ...

    def shape_cohort(self, round: Round | None, cohort: Cohort) -> None: ...

    def on_results(self, round: Round) -> None: ...

    def admit(self, round: Round) -> None: ...

    def aggregation_weights(self, round: Round) -> Callable[[Sequence[int]], Tensor] | None:
        """Fixed aggregation weights of the reporting clients (None: the round plan's)."""
        return None

    def combine(self, round: Round, weights: Tensor) -> Payload | None:
        """The round's uploads combined into the algorithm's ``upload_sum`` (None: not this stage)."""
        return None

    def add_to_sum(self, round: Round, sums: Payload) -> Payload:
        return sums

    adds_to_sum: ClassVar[bool] = False
    """Whether ``add_to_sum`` changes the sum (the round then aggregates through sums)."""

    def finish(self, round: Round, reporting: int) -> None: ...

    def after_step(self, round: Round) -> None: ...

    def checkpoint(self) -> dict[str, Any]:
        """Entries for the checkpoint's federated state (written only when not empty)."""
        return {}

    def restore(self, saved: dict[str, Any]) -> None:
        """Restore from the checkpoint's federated state (``saved``: all of it)."""
