"""The algorithm interface: state declarations, a client update rule, an aggregate.

An algorithm holds no tensors between rounds. Per round the module calls

1. ``broadcast(x, server_state, info)``  -> what the server sends each active client;
2. per client: ``client_init`` once, ``client_step`` per local step,
   ``client_finish`` once -> the upload payload and the client's new state;
3. ``aggregate(x, uploads, weights, server_state, info)`` -> the server
   pseudo-gradient and new server state. The server optimizer from
   ``server_optimizer`` applies the pseudo-gradient to the global parameters
   (SGD with lr = global lr gives ``x <- x - lr * pseudo_grad``).

Client rules take and return tensor dicts and use only elementwise tensor ops,
so they also run on clients stacked along a leading dimension.

Personal tensors (partial personalization): if the model has personal tensors
and the algorithm sets ``supports_personal``, ``params`` in the client rule
holds the shared *and* the client's personal tensors (``ctx.personal`` has the
personal values at the start of the round, so ``ctx.personal.keys()`` names
them); ``ctx.grad`` differentiates both. ``client_finish`` sees only the shared
tensors, and ``personal_finish`` returns the personal tensors the client keeps.
Without personal tensors nothing of this is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fl_lightning import params as P
from fl_lightning.params import TensorDict
from fl_lightning.participation import RoundPlan
from fl_lightning.state import NestedState

Payload = dict[str, TensorDict]
"""A message between server and client: ``{"x": params, "c": control variate, ...}``."""

GradFn = Callable[[TensorDict], tuple[Tensor, TensorDict]]


@dataclass
class RoundInfo:
    """Facts about the current round that rules may depend on."""

    round: int
    local_lr: float  # this round's eta_l (after per-round decay)
    num_clients: int  # N, the population size
    local_steps: float = 0.0  # mean number of local steps of the round's clients (known at aggregation)
    plan: RoundPlan | None = None  # the round's active clients and seeds (e.g. to draw a subset of them)
    personal_lr: float | None = None  # this round's gamma_v for personal tensors (None: local_lr)


@dataclass
class ClientContext:
    """Everything a client rule may read besides its parameters and local state."""

    client_id: int
    broadcast: Payload
    client_state: NestedState
    info: RoundInfo
    num_steps: int  # K for this client this round
    grad: GradFn = None  # minibatch loss and gradient (weight decay included) at given params
    full_grad: Callable[[TensorDict], TensorDict] = None  # gradient over the client's whole training set
    step: int = 0
    personal: TensorDict = field(default_factory=dict)  # the client's personal tensors at the start of the round
    mean_grad: Callable[[TensorDict], TensorDict] = None  # mean minibatch gradient over the round's K batches

    @property
    def lr(self) -> float:
        return self.info.local_lr

    @property
    def personal_lr(self) -> float:
        """gamma_v, the step size of personal tensors (``local.personal_lr``, default ``lr``)."""
        return self.info.local_lr if self.info.personal_lr is None else self.info.personal_lr


@dataclass
class ClientResult:
    client_id: int
    upload: Payload
    client_state: NestedState
    num_steps: int
    mean_loss: float
    personal: TensorDict = field(default_factory=dict)  # the client's new personal tensors (never uploaded)


class Algorithm:
    """Base class; subclasses override only what their rule changes.

    Args:
        global_lr: the server learning rate eta_g.
    """

    #: Whether the client rule handles personal tensors in ``params`` (see the module docstring).
    supports_personal: bool = False
    #: Whether every client runs ``client_warmup`` before the first round (e.g. Scaffold-P's c_i^0).
    warmup_pass: bool = False

    #: Batched execution stacks clients under vmap, where ``ctx.client_id`` is not known:
    #: a rule that branches on the client's id sets this to False (it then runs sequentially).
    batchable = True

    #: Whether ``client_init``/``client_step``/``client_finish`` use only elementwise tensor ops
    #: (no norms, sums or other reductions over a tensor), so that batched execution can apply
    #: them once to all clients' stacked tensors instead of per client under vmap (much faster).
    #: A subclass that adds a reduction must set it back to False.
    elementwise = False

    def __init__(self, global_lr: float = 1.0) -> None:
        if not global_lr > 0:
            raise ValueError(f"algorithm global_lr must be > 0, got {global_lr}")
        self.global_lr = global_lr

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
        self, x: TensorDict, uploads: Sequence[Payload], weights: Tensor, server_state: NestedState, info: RoundInfo
    ) -> tuple[TensorDict, NestedState]:
        """Pseudo-gradient ``-sum_i w_i delta_i`` (FedAvg's aggregate) and unchanged server state."""
        return P.scale(P.weighted_sum([u["delta"] for u in uploads], weights), -1.0), server_state

    def server_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.global_lr)
