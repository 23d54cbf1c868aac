"""The algorithm interface: state declarations, a client update rule, an aggregate.

An algorithm holds no tensors between rounds. Per round the module calls

1. ``broadcast(x, server_state, info)``  -> what the server sends each active client;
2. per client: ``client_init`` once, ``client_step`` per local step,
   ``client_finish`` once -> the upload payload and the client's new state;
3. ``aggregate(x, uploads, weights, server_state, info, local_steps)`` -> the server
   pseudo-gradient and new server state. The server optimizer from
   ``server_optimizer`` applies the pseudo-gradient to the global parameters
   (SGD with lr = global lr gives ``x <- x - lr * pseudo_grad``).

Client rules take and return tensor dicts, so batched execution can run them on
clients stacked along a leading dimension: once on the stacked tensors if the rule's
own class declares ``elementwise = True`` (``declares_capability``), else per client
under ``torch.func.vmap``. Under batching ``ctx.client_id`` raises
``ClientIdUnavailable`` (``ctx.client`` holds the stacked ids as a tensor); a
``client_finish`` that needs the id is then run client by client.

Personal tensors (partial personalization): if the model has personal tensors
and the algorithm sets ``supports_personal``, ``params`` in the client rule
holds the shared *and* the client's personal tensors (``ctx.personal`` has the
personal values at the start of the round, so ``ctx.personal.keys()`` names
them); ``ctx.grad`` differentiates both. ``client_finish`` sees only the shared
tensors, and ``personal_finish`` returns the personal tensors the client keeps.
Without personal tensors nothing of this is visible.

Personalized models (docs/architecture.md, "Personalized models"): a client may keep a whole model of
its own, or any tensors, as ordinary client state (``client_state_init``), trained by its own rule
beside the shared parameters (``ctx.grad`` takes any parameters). What each client predicts with is
declared by ``personal_model`` (default: the global tensors with the client's personal ones), and
``personalize`` adapts it at evaluation from the client's training data (default: unchanged). A
client rule may read the model's outputs on its whole training set through ``ctx.data_pass``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core import params as P
from fl_lightning.core.capabilities import declared
from fl_lightning.core.local_loss import LossContext, ModelOutputs, defines_local_loss, keeps_model_loss
from fl_lightning.core.objective import GradFn
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import RoundInfo
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import ClientResult, Payload

__all__ = [
    "Algorithm", "ClientContext", "DataPass", "ClientIdUnavailable", "ClientResult", "LossContext", "ModelOutputs", "Payload", "RoundInfo",
    "declares_capability", "defines_local_loss",
]  # fmt: skip


class ClientIdUnavailable(RuntimeError):
    """A rule asked for one client's id where several clients run stacked."""


@dataclass
class ClientContext:
    """Everything a client rule may read besides its parameters and local state.

    ``client`` is the client's id, or under batched execution the stacked clients' ids
    (an int64 tensor aligned with the leading dimension; a 0-dim tensor under vmap).
    """

    client: int | Tensor
    broadcast: Payload
    client_state: NestedState
    info: RoundInfo
    num_steps: int  # K for this client this round
    grad: GradFn = None  # minibatch loss and gradient (weight decay included) at given params
    full_grad: Callable[[TensorDict], TensorDict] = None  # gradient over the client's whole training set
    step: int = 0
    personal: TensorDict = field(default_factory=dict)  # the client's personal tensors at the start of the round
    mean_grad: Callable[[TensorDict], TensorDict] = None  # mean minibatch gradient over the round's K batches
    data_pass: Callable[[TensorDict], DataPass] = None  # the model's outputs on the client's whole training set

    @property
    def client_id(self) -> int:
        """The client's id; raises ``ClientIdUnavailable`` where clients run stacked."""
        if isinstance(self.client, Tensor):
            raise ClientIdUnavailable(
                "ctx.client_id is not one number where clients run stacked; use ctx.client (their ids as a tensor)"
            )
        return self.client

    @property
    def lr(self) -> float:
        return self.info.local_lr

    @property
    def personal_lr(self) -> float:
        """gamma_v, the step size of personal tensors (``local.personal_lr``, default ``lr``)."""
        return self.info.local_lr if self.info.personal_lr is None else self.info.personal_lr


@dataclass(frozen=True)
class DataPass:
    """The model's outputs on a client's whole training set at given parameters (``ctx.data_pass``).

    ``features`` is the representation the head reads (``[n, d]``), ``logits`` ``[n, C]``,
    ``target`` ``[n]``; ``mask`` ``[n]`` is 1.0 for the client's samples and 0.0 for padding rows
    (where clients of different sizes run stacked), so a statistic written with it, e.g. a class
    mean ``sum(mask * onehot * z) / sum(mask * onehot)``, is the same either way. Computed without
    gradient.
    """

    features: Tensor
    logits: Tensor
    target: Tensor
    mask: Tensor


_RULE_METHODS = ("client_init", "client_step", "client_finish", "personal_finish")
_AGGREGATE_METHODS = ("aggregate", "upload_sum", "aggregate_sum")
_CAPABILITY_METHODS = {"linear_aggregate": _AGGREGATE_METHODS, "local_loss_ignores_padded_rows": ("local_loss",)}  # else the rule's methods


def declares_capability(algorithm: object, capability: str) -> bool:
    """Whether ``algorithm`` has ``capability`` (e.g. ``elementwise``) set by the class that wrote its rule.

    True only if the class declaring the flag is (a subclass of) every class that defines one of
    the rule's methods: a subclass that overrides ``client_step`` (say, to clip the gradient by
    its global norm) does not inherit its parent's ``elementwise = True``; it must declare it.
    For ``linear_aggregate`` the rule is the server's: ``aggregate``, ``upload_sum``, ``aggregate_sum``.
    """
    return declared(algorithm, capability, _CAPABILITY_METHODS.get(capability, _RULE_METHODS))


class Algorithm:
    """Base class; subclasses override only what their rule changes.

    Args:
        global_lr: the server learning rate eta_g.
    """

    #: Whether the client rule handles personal tensors in ``params`` (see the module docstring).
    supports_personal: bool = False
    #: Whether the client rule reads gamma_v (``ctx.personal_lr``, ``local.personal_lr``) beyond personal tensors
    #: (Ditto's and pFedMe's personal models); with personal tensors every algorithm that trains them reads it.
    reads_personal_lr: bool = False
    #: Whether every client runs ``client_warmup`` before the first round (e.g. Scaffold-P's c_i^0).
    warmup_pass: bool = False

    #: Whether batched execution may run this rule at all (a rule it cannot run sets False:
    #: its clients then train one after another).
    batchable = True

    #: Whether ``client_init``/``client_step``/``client_finish`` use only elementwise tensor ops
    #: (no norms, sums or other reductions over a tensor), so that batched execution can apply
    #: them once to all clients' stacked tensors instead of per client under vmap (much faster).
    #: Honoured only where the class that writes the rule declares it (``declares_capability``).
    elementwise = False

    #: Whether ``aggregate`` reads the uploads only through ``upload_sum``, a sum over clients, as
    #: ``aggregate_sum(x, upload_sum(x, uploads, weights), ...)``. Under DDP each process then sums
    #: its own clients' uploads and the processes all-reduce the sums instead of gathering every
    #: upload (``DistributedExecutor``). Honoured only where the class declaring it wrote all three
    #: methods (``declares_capability``): a subclass that rewrites ``aggregate`` gathers until it
    #: declares it. True here: the base ``aggregate`` (FedAvg's) is ``-sum_i w_i delta_i``.
    linear_aggregate = True

    #: Whether the server rule (``broadcast``, ``aggregate``, client and server state) is defined for
    #: asynchronous arrivals, each from its own model version (docs/algorithms.md, 27): FedAvg's weighted
    #: sum of stateless clients' deltas is. Honoured only where the declaring class wrote every server
    #: rule it runs (``fl_lightning.clock.asynchronous.defined_asynchronously``): SCAFFOLD, FedDyn are refused.
    asynchronous = True

    #: Whether ``local_loss`` reads ``out.features``, the model's representation (the model must
    #: define ``representation`` and ``head``: docs/architecture.md, "The local objective").
    needs_features = False
    #: Whether ``local_loss`` reads ``ctx.label_counts``, the client's training samples per class
    #: (the data must define ``client_label_counts``).
    needs_label_counts = False
    #: The names of the upload's entries, each a tensor dict shaped like the federated tensors x
    #: (message stages that add to the uploads' sum, e.g. privacy's noise, need their structure).
    #: Honoured only where the class declaring it wrote ``client_finish`` (``declares_capability``).
    #: ``()`` declared there says the upload holds nothing shaped like x (FedProto's prototypes): client-level DP
    #: and uplink compression are then refused, and an upload without ``delta`` adds nothing to ``train/consistency``.
    upload_entries: tuple[str, ...] = ("delta",)

    #: Upload entries that are increments of a client state which the server mirrors by summing
    #: them (SCAFFOLD's ``delta_c``: c stays the mean of the c_i). Message transforms that change
    #: an upload (compression, docs/algorithms.md 21) must not let that mirror drift.
    mirrored_uploads: tuple[str, ...] = ()

    def __init__(self, global_lr: float = 1.0) -> None:
        if not global_lr > 0:
            raise ValueError(f"algorithm global_lr must be > 0, got {global_lr}")
        self.global_lr = global_lr

    def check_local(self, local: Any) -> None:
        """Refuse local training (``LocalTraining``) this rule cannot run, before any training: a one-line
        ``ValueError`` naming the setting (default: every local training is fine)."""

    def bind_data(self, data: Any) -> None:
        """Read the facts of the clients' data the rule needs (e.g. AFL's domains and client sizes), before
        ``server_state_init``; the module calls it at setup on every process. A one-line ``ValueError`` where the data
        lacks them (default: nothing is read)."""

    # ---- state declarations -------------------------------------------------
    def client_state_init(self, x: TensorDict) -> NestedState:
        """Initial persistent state of a client never seen before."""
        return {}

    def server_state_init(self, x: TensorDict) -> NestedState:
        return {}

    # ---- server -> client ---------------------------------------------------
    def broadcast(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        return {"x": x}

    # ---- client rule ----------------------------------------------------------
    def client_init(self, params: TensorDict, ctx: ClientContext) -> NestedState:
        """Local (per-round) optimizer state, e.g. Adam's first moment."""
        return {}

    def client_step(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[TensorDict, NestedState]:
        raise NotImplementedError

    def client_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """Upload ``{"delta": x_i - x}`` and keep the client state unchanged."""
        return {"delta": P.sub(params, ctx.broadcast["x"])}, ctx.client_state

    def personal_finish(self, params: TensorDict, local: NestedState, ctx: ClientContext) -> TensorDict:
        """The personal tensors the client keeps: ``v_{i,K}`` (the values after the last step)."""
        return {k: params[k] for k in ctx.personal}

    # ---- the model each client predicts with (docs/algorithms.md, section 25, (25.1)-(25.2)) -----------
    #: How many times evaluation runs ``personalize_step``, each on one of the client's training batches; 0: never.
    personalize_steps: int = 0

    def personal_model(self, x: TensorDict, client_state: NestedState, personal: TensorDict) -> TensorDict:
        """The parameters client i predicts with (25.1), from the global tensors ``x``, its stored state
        and its personal tensors: here ``x`` with the personal tensors (the global model without them).
        Every evaluation of a client's own data uses it (then ``personalize_step``)."""
        return {**x, **personal}

    def personalize_step(self, params: TensorDict, ctx: ClientContext) -> TensorDict:
        """One step of adaptation at evaluation (25.2), run ``personalize_steps`` times from ``personal_model``'s
        parameters, ``ctx.grad`` on one of the client's training batches (``ctx.step`` counts them;
        ``ctx.client_state``/``ctx.personal`` as stored, ``ctx.broadcast["x"]`` the global tensors).
        Here: unchanged (Per-FedAvg takes a gradient step, FedBABU fine-tunes its head)."""
        return params

    # ---- the local objective (optional: fl_lightning.core.local_loss) ------------------------
    @keeps_model_loss
    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]:
        """The client's loss on a batch as named terms, summed into the loss ``ctx.grad`` differentiates
        and logged as ``train/loss/<term>``. Not defined here: without it the model's own loss is used."""
        raise NotImplementedError

    # ---- optional warm-up pass over all clients before round 0 -----------------
    def client_warmup(self, params: TensorDict, ctx: ClientContext) -> tuple[Payload, NestedState]:
        """Upload and initial state of one client (``ctx.mean_grad`` averages K fresh minibatches)."""
        return {}, ctx.client_state

    def server_warmup(
        self, x: TensorDict, uploads: Sequence[Payload], server_state: NestedState, info: RoundInfo
    ) -> NestedState:
        """Initial server state from every client's warm-up upload (clients in id order)."""
        return server_state

    # ---- server update ----------------------------------------------------------
    def aggregate(
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo,
        local_steps: Sequence[int],
    ) -> tuple[TensorDict, NestedState]:
        """Pseudo-gradient ``-sum_i w_i delta_i`` (FedAvg's aggregate) and unchanged server state.

        ``local_steps[i]`` is the number of local steps client i ran (its upload is ``uploads[i]``).
        """
        return self.aggregate_sum(x, self.upload_sum(x, uploads, weights, info), server_state, info, local_steps)

    def upload_sum(self, x: TensorDict, uploads: Sequence[Payload], weights: Sequence[float] | Tensor, info: RoundInfo) -> Payload:
        """The sums over clients that ``aggregate_sum`` reads: here ``{"delta": sum_i w_i delta_i}``.

        Must be additive over disjoint sets of clients (DDP adds the processes' partial sums) and
        have the same names and shapes for any set of clients, zeros for none.
        """
        return {"delta": weighted_sum_or_zeros(P.part(uploads, "delta"), weights, x)}

    def aggregate_sum(
        self, x: TensorDict, sums: Payload, server_state: NestedState, info: RoundInfo, local_steps: Sequence[int]
    ) -> tuple[TensorDict, NestedState]:
        """``aggregate`` from ``upload_sum`` over all reporting clients (``local_steps`` in their order)."""
        return P.scale(sums["delta"], -1.0), server_state

    def metrics(self, server_state: NestedState, info: RoundInfo) -> dict[str, float]:
        """Algorithm-specific values logged after each round as ``algo/<name>`` (e.g. a control-variate norm)."""
        return {}

    def server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.global_lr)


def weighted_sum_or_zeros(dicts: Sequence[TensorDict], weights: Sequence[float] | Tensor, like: TensorDict) -> TensorDict:
    """``P.weighted_sum``, or zeros shaped like ``like`` for no dicts (a process whose clients all failed)."""
    return P.weighted_sum(dicts, weights) if len(dicts) else P.zeros_like(like)


def mean_steps(local_steps: Sequence[int]) -> float:
    """The mean number of local steps of a round's reporting clients."""
    return sum(local_steps) / len(local_steps)
