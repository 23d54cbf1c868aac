"""What the module hands an executor for one client, and what it gets back.

Each round the module turns the round plan into client tasks once: the client's id,
its round seed, its local step budget K (the only place K is computed), the
broadcast, and a loader of its persistent state. Executors run tasks and return
results; they never see the module, the plan or the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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
