"""The message pipeline: composable transforms of what clients and server send each other.

Contract (docs/architecture.md, "Message pipeline"): a round's messages pass through

* the **uplink**: each reporting client's upload (``{"delta": ..., "delta_c": ...}``) through the
  ``ClientStage`` s in order (clip, then compress), on the client's side, each with its own
  per-client state (e.g. an error-feedback residual) kept in the client store; then, on the server,
  the ``AggregateStage`` s (noise) act on the *sum* of the transformed uploads;
* the **downlink**: the broadcast through the ``BroadcastStage`` s, on the server, once a round
  (every client receives the same message), with server-held state.

Stages are ordered by ``order`` (``CLIP`` < ``COMPRESS`` < ``NOISE``; stable for equal orders).
A stage reports the encoded size of what it sends (``Sent.nbytes``); ``comm/round_bytes_up`` and
``_down`` count those sizes. Randomness derives from ``StageKey``: a client stage's from the
client's round seed (itself ``derive_seed(seed, round, client)``), an aggregate or broadcast
stage's from ``derive_seed(seed, round, SERVER_STREAM)``: the same on every process and for
every executor. With no stage configured nothing of this runs: the round is what it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.executors.base import ClientRuntime, Executor
from fl_lightning.core.participation import derive_seed
from fl_lightning.core.state import NestedState, flatten_state, unflatten_state
from fl_lightning.core.tasks import ClientResult, ClientTask, Payload, SummedRound

CLIP, COMPRESS, NOISE = 0, 1, 2
"""``Stage.order`` values: the pipeline applies clip, then compress, then noise."""

STATE_PREFIX = "msg:"
"""Client-state names ``msg:<stage>:<entry>`` hold the stages' per-client state (the algorithm never sees them)."""

SERVER_STREAM = 0x5E7
"""Seed stream of server-side stages: ``derive_seed(data.seed, round, SERVER_STREAM)``."""


@dataclass(frozen=True)
class StageKey:
    """Where a stage runs and its seed.

    ``seed``: for a client stage the client's round seed (``derive_seed(data.seed, round, client)``),
    for a server stage ``derive_seed(data.seed, round, SERVER_STREAM)``; ``client`` is None server-side.
    """

    seed: int
    round: int
    client: int | None = None

    def generator(self, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for one use of randomness (``stream``: a constant of the stage), fixed by the key."""
        return torch.Generator(device).manual_seed(derive_seed(self.seed, stream))


@dataclass
class Sent:
    """A stage's output: the message as the receiver reconstructs it (dense tensors), the stage's new
    state, and the encoded size in bytes of what travels (None: the size of the stage's input)."""

    message: Payload
    state: NestedState = field(default_factory=dict)
    nbytes: int | None = None


class Stage:
    """One transform. Subclasses set ``order`` and ``name`` (unique in a pipeline; no ``:`` or ``/``)."""

    order: ClassVar[int] = COMPRESS
    name: ClassVar[str] = "stage"

    def check(self, algorithm: Any, num_clients: int) -> None:
        """Raise ``ValueError`` (one line naming the setting) before training if this stage cannot run
        with ``algorithm``."""

    def begin_round(self, info: RoundInfo) -> None:
        """Called on the server before the round's broadcast (e.g. to set an adaptive clip norm);
        must do the same on every process."""

    def end_round(self, info: RoundInfo, reporting: int) -> dict[str, float]:
        """Called on the server after the round's aggregate (``reporting`` clients reported);
        returns metrics to log with the round (e.g. ``privacy/epsilon``)."""
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        """Server-held state to checkpoint (tensors only; e.g. an accountant's history)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore ``state_dict``'s output on resume."""


class ClientStage(Stage):
    """Uplink, per client, on the client's side (clip, compress)."""

    def apply(self, upload: Payload, state: NestedState, key: StageKey) -> Sent:
        """The transformed upload and this client's new state for this stage (``state``: its previous
        one, ``{}`` for a client never seen). The upload's entries are ``{name: {param: tensor}}``."""
        raise NotImplementedError


class AggregateStage(Stage):
    """Uplink, on the server, on the sum of the clients' transformed uploads (noise).

    The server sums the uploads as ``algorithm.upload_sum(x, uploads + [extra], weights + [w])``:
    the stage fixes the clients' aggregation ``weights`` (e.g. ``1 / expected cohort size``) and
    contributes one ``extra`` pseudo-upload (e.g. Gaussian noise) with weight ``w`` (the same).
    This needs an algorithm whose aggregate is linear in the uploads (``linear_aggregate``).
    """

    def weight(self, info: RoundInfo) -> float:
        """Each reporting client's aggregation weight (and the extra upload's)."""
        raise NotImplementedError

    def extra_upload(self, like: Payload, key: StageKey) -> Payload | None:
        """The pseudo-upload added to the sum, shaped like ``like`` (None: nothing)."""
        return None


class BroadcastStage(Stage):
    """Downlink, on the server, once a round: the broadcast every client receives."""

    def apply(self, broadcast: Payload, state: NestedState, key: StageKey) -> Sent:
        raise NotImplementedError


def upload_like(algorithm: Any, x: Any) -> Payload:
    """The structure of the algorithm's upload: ``{entry: x}`` for each name in its declared
    ``upload_entries`` (each entry shaped like the federated tensors x), or ``{}`` if the class that
    wrote ``client_finish`` declares none (``declares_capability``)."""
    from fl_lightning.core.capabilities import declared

    if not declared(algorithm, "upload_entries", ("client_finish",)):
        return {}
    return {entry: x for entry in algorithm.upload_entries}


def sends_no_model_shaped_upload(algorithm: Any) -> bool:
    """Whether the class that wrote the algorithm's ``client_finish`` (or a subclass of it) declares
    ``upload_entries = ()``: its uploads hold no tensor dict shaped like the federated tensors (FedProto's
    class prototypes), so stages that transform model updates (clipping and noise, compression) do not apply."""
    mro = type(algorithm).__mro__
    declarer = next((c for c in mro if "upload_entries" in vars(c)), None)
    writer = next((c for c in mro if "client_finish" in vars(c)), None)
    if declarer is None or writer is None or not issubclass(declarer, writer):
        return False
    return not tuple(vars(algorithm).get("upload_entries", vars(declarer)["upload_entries"]))


def add_sums(a: Payload, b: Payload | None) -> Payload:
    """``a + b`` entry by entry (``b`` None: ``a``)."""
    if b is None:
        return a
    return {n: {k: v + b[n][k].to(v.dtype) for k, v in td.items()} for n, td in a.items()}


def state_name(stage: Stage, entry: str) -> str:
    return f"{STATE_PREFIX}{stage.name}:{entry}"


def is_message_state(name: str) -> bool:
    return name.startswith(STATE_PREFIX)


def stage_state(stage: Stage, stored: NestedState) -> NestedState:
    """The stage's own part of a client's stored state (``msg:<stage>:<entry>`` -> ``entry``)."""
    prefix = state_name(stage, "")
    return {n[len(prefix) :]: td for n, td in stored.items() if n.startswith(prefix)}


class MessagePipeline:
    """The uplink and downlink stages of a run (empty: no transform at all).

    Args:
        uplink: ``ClientStage`` s and ``AggregateStage`` s (sorted by ``order``; client stages
            must come before aggregate stages).
        downlink: ``BroadcastStage`` s.
    """

    def __init__(self, uplink: Sequence[Stage] = (), downlink: Sequence[Stage] = ()) -> None:
        uplink = sorted(uplink, key=lambda s: s.order)
        self.client_stages = [s for s in uplink if isinstance(s, ClientStage)]
        self.aggregate_stages = [s for s in uplink if isinstance(s, AggregateStage)]
        self.broadcast_stages = sorted(downlink, key=lambda s: s.order)
        other = [s for s in uplink if not isinstance(s, (ClientStage, AggregateStage))]
        other += [s for s in downlink if not isinstance(s, BroadcastStage)]
        if other:
            raise ValueError(
                f"message stage {type(other[0]).__name__} is not a ClientStage/AggregateStage (uplink) or BroadcastStage (downlink)"
            )
        if len(self.aggregate_stages) > 1:
            raise ValueError("at most one AggregateStage (e.g. privacy's noise) may act on the uplink's sum")
        if any(s.order < c.order for s in self.aggregate_stages for c in self.client_stages):
            raise ValueError("an AggregateStage acts on the sum, after every client stage: give it the larger order")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"message stages need distinct names, got {names}")
        self.server_state: NestedState = {}  # downlink stages' state, ``msg:<stage>:<entry>``

    @property
    def stages(self) -> list[Stage]:
        return [*self.client_stages, *self.aggregate_stages, *self.broadcast_stages]

    def __bool__(self) -> bool:
        return bool(self.stages)

    @property
    def aggregate(self) -> AggregateStage | None:
        return self.aggregate_stages[0] if self.aggregate_stages else None

    def check(self, algorithm: Any, num_clients: int) -> None:
        for stage in self.stages:
            stage.check(algorithm, num_clients)

    def begin_round(self, info: RoundInfo) -> None:
        for stage in self.stages:
            stage.begin_round(info)

    def end_round(self, info: RoundInfo, reporting: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for stage in self.stages:
            metrics.update(stage.end_round(info, reporting))
        return metrics

    def state_dict(self) -> dict[str, Tensor]:
        """Everything server-side to checkpoint: the downlink stages' state and each stage's ``state_dict``."""
        out = {f"server/{k}": v for k, v in flatten_state(self.server_state).items()}
        for stage in self.stages:
            out.update({f"stage/{stage.name}/{k}": v for k, v in stage.state_dict().items()})
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.server_state = unflatten_state({k[len("server/") :]: v for k, v in state.items() if k.startswith("server/")})
        for stage in self.stages:
            prefix = f"stage/{stage.name}/"
            stage.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})

    # ---- uplink, client side ------------------------------------------------------------------
    def transform_upload(self, result: ClientResult, stored: NestedState, key: StageKey) -> ClientResult:
        """``result`` with its upload through the client stages, its stage states merged into its
        client state, and ``upload_bytes`` the last stage's encoded size."""
        upload, state, nbytes = result.upload, dict(result.client_state), result.upload_bytes
        for stage in self.client_stages:
            sent = stage.apply(upload, stage_state(stage, stored), key)
            upload = sent.message
            nbytes = sent.nbytes if sent.nbytes is not None else nbytes
            state.update({state_name(stage, entry): td for entry, td in sent.state.items()})
        return dataclasses.replace(result, upload=upload, client_state=state, upload_bytes=nbytes)

    # ---- uplink, server side ---------------------------------------------------------------------
    def aggregation_weights(self, info: RoundInfo) -> Callable[[Sequence[int]], Tensor] | None:
        """The clients' weights under an aggregate stage (None: the round plan's)."""
        stage = self.aggregate
        if stage is None:
            return None
        weight = stage.weight(info)
        return lambda reporting: torch.full((len(reporting),), weight, dtype=torch.float64)

    def extra_sum(self, algorithm: Any, x: Any, like: Payload, info: RoundInfo, seed: int) -> Payload | None:
        """``algorithm.upload_sum`` of the aggregate stage's extra upload (added to the clients' sums)."""
        stage = self.aggregate
        if stage is None:
            return None
        extra = stage.extra_upload(like, StageKey(derive_seed(seed, info.round, SERVER_STREAM), info.round))
        if extra is None:
            return None
        return algorithm.upload_sum(x, [extra], [stage.weight(info)], info)

    # ---- downlink --------------------------------------------------------------------------------
    def transform_broadcast(self, broadcast: Payload, info: RoundInfo, seed: int) -> tuple[Payload, int | None]:
        """The broadcast through the downlink stages (their state kept in ``server_state``) and its
        encoded size (None: unchanged)."""
        nbytes = None
        key = StageKey(derive_seed(seed, info.round, SERVER_STREAM), info.round)
        for stage in self.broadcast_stages:
            sent = stage.apply(broadcast, stage_state(stage, self.server_state), key)
            broadcast, nbytes = sent.message, sent.nbytes if sent.nbytes is not None else nbytes
            self.server_state.update({state_name(stage, e): td for e, td in sent.state.items()})
        return broadcast, nbytes


class MessageExecutor(Executor):
    """Runs the wrapped executor, then each trained client's upload through the pipeline's client
    stages (so sequential, batched and DDP execution send the same transformed uploads: under DDP
    this runs on each process for its own clients, before ``DistributedExecutor`` sums or gathers).
    The warm-up pass's uploads are not transformed."""

    def __init__(self, inner: Executor, pipeline: MessagePipeline) -> None:
        self.inner, self.pipeline = inner, pipeline

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> list[ClientResult]:
        results = self.inner.run(tasks, info, runtime)
        if not self.pipeline.client_stages:
            return results
        by_id = {t.client_id: t for t in tasks}
        out = []
        for result in results:
            task = by_id[result.client_id]
            if task.warmup:
                out.append(result)
                continue
            stored = task.load_message_state() if task.load_message_state is not None else {}
            out.append(self.pipeline.transform_upload(result, stored, StageKey(task.seed, info.round, result.client_id)))
        return out

    def run_summed(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> SummedRound | None:
        return None  # one process: the module sums the (transformed) uploads
