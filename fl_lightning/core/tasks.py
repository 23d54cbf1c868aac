"""What the module hands an executor for one client, and what it gets back.

Each round the module turns the round plan into client tasks once: the client's id,
its round seed, its local step budget K (the only place K is computed), the
broadcast, and a loader of its persistent state; a round's tasks come as columns
(``RoundTasks``), a ``ClientTask`` made only where an executor takes one client at a time.
Executors run tasks and return results; they never see the module, the plan or the store.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from fl_lightning.core.metrics import payload_bytes
from fl_lightning.core.params import TensorDict
from torch import Tensor

from fl_lightning.core.state import NestedState

Payload = dict[str, TensorDict]
"""A message between server and client: ``{"x": params, "c": control variate, ...}``."""

PERSONAL = "personal"
"""The client-state entry holding a client's personal tensors (a reserved state name)."""


class ClientState(NamedTuple):
    """A client's persistent state: the algorithm's (e.g. SCAFFOLD's ``{"c": ...}``) and its personal tensors."""

    algorithm: NestedState
    personal: TensorDict


class StateTable(Protocol):
    """The round's client states as stacked tables: an executor that stacks clients reads them in one call."""

    def gather(self, ids: Tensor) -> ClientState | None:
        """The clients' states (``ids``: client ids, LongTensor [S]), every tensor stacked ``[S, ...]`` on the
        clients' device, the same values ``ClientTask.load_state`` gives; None: load them client by client."""


@dataclass(frozen=True)
class ClientTask:
    """One client's work in a round.

    ``load_state`` reads the client's state from the store when the client trains
    (an executor that runs on another process never loads the clients it does not run).
    ``warmup`` marks the algorithm's pass over every client before round 0. ``states``, shared by the
    round's tasks, loads the same states as ``load_state`` for many clients at once (stacked).
    """

    client_id: int
    seed: int
    num_steps: int
    broadcast: Payload
    load_state: Callable[[], ClientState]
    warmup: bool = False
    load_message_state: Callable[[], NestedState] | None = None  # the message stages' stored state (``fl_lightning.pipeline.messages``)
    states: StateTable | None = None  # the round's table of client states (``load_state`` of many clients at once)


class TaskColumns(NamedTuple):
    """The tasks' clients, round seeds and local step budgets, in task order."""

    client_ids: list[int]
    seeds: list[int]
    num_steps: list[int]


class RoundTasks(Sequence):
    """A round's client tasks as columns (``TaskColumns``) and what the clients share: an executor that stacks
    them reads the columns; a ``ClientTask`` is made only where a reader takes one client at a time.

    ``broadcast`` is every client's, unless ``own_broadcasts`` gives some clients (by task position) their
    own (heterogeneous LoRA ranks). ``load_state`` and ``load_message_state`` take a client's id.
    """

    def __init__(
        self, columns: TaskColumns, broadcast: Payload, load_state: Callable[[int], ClientState], warmup: bool = False,
        load_message_state: Callable[[int], NestedState] | None = None, states: StateTable | None = None,
        own_broadcasts: dict[int, Payload] | None = None,
    ) -> None:
        self.columns, self.broadcast, self.warmup, self.states = columns, broadcast, warmup, states
        self._load_state, self._load_message_state, self._own = load_state, load_message_state, own_broadcasts or {}
        self._tasks: list[ClientTask | None] = [None] * len(columns.client_ids)

    @property
    def shared_broadcast(self) -> bool:
        """Whether every client receives ``broadcast`` itself."""
        return not self._own

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        task = self._tasks[index]
        if task is None:
            c = self.columns
            cid = c.client_ids[index]
            load_messages = None if self._load_message_state is None else functools.partial(self._load_message_state, cid)
            task = ClientTask(
                cid, c.seeds[index], c.num_steps[index], self._own.get(index % len(self), self.broadcast),
                functools.partial(self._load_state, cid), self.warmup, load_messages, self.states,
            )  # fmt: skip
            self._tasks[index] = task
        return task

    def subset(self, positions: Sequence[int]) -> RoundTasks:
        """The tasks at ``positions``, in that order (columns still)."""
        c = self.columns
        chosen = TaskColumns([c.client_ids[p] for p in positions], [c.seeds[p] for p in positions], [c.num_steps[p] for p in positions])
        own = {i: self._own[p] for i, p in enumerate(positions) if p in self._own}
        return RoundTasks(chosen, self.broadcast, self._load_state, self.warmup, self._load_message_state, self.states, own)


def task_columns(tasks: Sequence[ClientTask]) -> TaskColumns:
    """The tasks' ``TaskColumns`` (read off ``RoundTasks``, or from each task of a list)."""
    if isinstance(tasks, RoundTasks):
        return tasks.columns
    return TaskColumns([t.client_id for t in tasks], [t.seed for t in tasks], [t.num_steps for t in tasks])


def subset(tasks: Sequence[ClientTask], positions: Sequence[int]) -> Sequence[ClientTask]:
    """The tasks at ``positions``, in that order (``RoundTasks`` stay columns)."""
    return tasks.subset(positions) if isinstance(tasks, RoundTasks) else [tasks[p] for p in positions]


def shares_broadcast(tasks: Sequence[ClientTask]) -> bool:
    """Whether every task carries the first task's broadcast itself."""
    if isinstance(tasks, RoundTasks):
        return tasks.shared_broadcast
    return all(t.broadcast is tasks[0].broadcast for t in tasks)


def shared_states(tasks: Sequence[ClientTask]) -> StateTable | None:
    """The round's table of client states where every task shares one, else None."""
    if isinstance(tasks, RoundTasks):
        return tasks.states
    table = tasks[0].states if tasks else None
    return table if table is not None and all(t.states is table for t in tasks) else None


@dataclass
class ClientResult:
    """A client's upload and its new state to store (its personal tensors, never uploaded, under ``PERSONAL``)."""

    client_id: int
    upload: Payload
    client_state: NestedState
    num_steps: int
    mean_loss: float
    accuracy: float = math.nan  # the fraction of its training samples predicted right during its steps (NaN: not a classifier)
    loss_terms: dict[str, float] = field(default_factory=dict)  # mean over steps of each named term of an algorithm's local_loss
    upload_bytes: int | None = None  # the upload's encoded size (message stages); None: the bytes of its tensors

    @property
    def sent_bytes(self) -> int:
        """The upload's encoded size (message stages, ``fl_lightning.pipeline.messages``), else the bytes of its tensors."""
        return self.upload_bytes if self.upload_bytes is not None else payload_bytes(self.upload)


@dataclass
class SummedRound:
    """A round whose uploads came back summed (an algorithm that declares ``linear_aggregate``, under DDP).

    ``results`` are every reporting client's, in task order, with ``upload = {}``: the uploads
    exist only as ``sums`` (``algorithm.upload_sum`` over all of them, with their aggregation
    weights). The round's metrics come from the rest: the bytes
    of each client's upload (the logical message), and for ``train/consistency`` the float64
    sum of the ``delta`` uploads and of their squared norms.
    """

    results: list[ClientResult]
    sums: Payload
    upload_bytes: list[int]
    delta_sum: TensorDict
    delta_sq_sum: float
    non_finite: list[int]  # clients whose upload held a NaN or Inf (they are in ``sums`` too)
