"""The local-objective contract: an algorithm's own loss on a client's batch (docs/architecture.md).

An algorithm that defines ``local_loss(out, target, ctx)`` replaces the model's loss in local
training: ``ctx.grad`` of its client rule returns the gradient of the sum of the named terms the
method returns (e.g. ``{"ce": ..., "contrastive": ...}``), and each term is logged per round as
``train/loss/<term>``. The method reads

- ``out``: the model's ``ModelOutputs`` on the batch at the client's current parameters
  (``logits``; ``features``, the representation the head reads, if the algorithm declares
  ``needs_features``);
- ``target``: the batch's targets;
- ``ctx``: a ``LossContext``: the broadcast, the client's stored state, the round's facts, the
  client's label counts (if it declares ``needs_label_counts``), ``params``, the parameters being
  trained (differentiated: a proximal term ``||params - broadcast["x"]||^2`` is a loss term; it may
  also hold tensors that are not the model's, e.g. a personal head kept in client state, which
  ``ctx.grad`` differentiates with the rest and only the local loss reads), and
  ``evaluate(params)``, the same model's outputs at other parameters on the same batch (a pure
  function: nothing is shared).

It is written for one client; batched execution runs it per client under ``torch.func.vmap``.

Masked stacking pads a client's short batch with rows whose target is ``IGNORE_TARGET`` (-100; ``ctx.padded_rows``
says the batch may hold them). ``F.cross_entropy`` ignores them; any other reduction over the rows must leave them out
(``row_mean``, ``real_rows``). An algorithm whose ``local_loss`` does declares ``local_loss_ignores_padded_rows = True``;
without it a round with padded rows runs sequentially (docs/performance.md, "Masked stacking").
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.func import vmap

from fl_lightning.core.client_data import IGNORE_TARGET
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import RoundInfo



class LossRule(Protocol):
    """What a bound local loss reads of its algorithm (``fl_lightning.algorithms.Algorithm`` implements it)."""

    def local_loss(self, out: ModelOutputs, target: Tensor, ctx: LossContext) -> dict[str, Tensor]: ...


class ModelOutputsSource(Protocol):
    """What a bound local loss reads of the objective (``fl_lightning.core.objective.Objective`` implements it)."""

    swap: Any  # its parameter slots (``swap.slots``: the names the model has)

    def outputs_at(self, params: TensorDict, batch: Any, features: bool) -> tuple[Any, Tensor]: ...

    def stacked_outputs(self, params: TensorDict, batch: Any, features: bool) -> tuple[Any, Tensor]: ...

Payload = dict[str, TensorDict]


@dataclass(frozen=True)
class ModelOutputs:
    """The model's outputs on a batch: ``logits`` and, where requested, ``features`` (the representation
    ``head`` maps to the logits: ``logits = model.head(features)``)."""

    logits: Tensor
    features: Tensor | None = None


@dataclass(frozen=True)
class LossContext:
    """What a local loss may read besides the outputs and targets, for one client on one batch.

    ``client`` is the client's id (a 0-dim tensor where clients run stacked); ``client_state`` its
    stored state; ``label_counts`` its training samples per class (int64 ``[C]``, None unless the
    algorithm declares ``needs_label_counts``); ``evaluate(params)`` the model's ``ModelOutputs`` on
    this batch with ``params`` substituted (any tensor not in ``params`` keeps the model's own value,
    the global model's); ``params`` the parameters the loss is taken at, the ones being trained (the
    gradient flows through them: a term reading them, e.g. FedProx's or Ditto's proximal term, is
    differentiated with the rest). ``params`` may hold tensors the model does not have (the rule passed
    them to ``ctx.grad``, e.g. FedRoD's personal head): the model's outputs use the model's tensors of
    ``params``, the loss reads the others, and ``ctx.grad`` returns their gradients too.
    """

    client: int | Tensor
    broadcast: Payload
    client_state: dict[str, TensorDict]
    info: RoundInfo
    label_counts: Tensor | None
    evaluate: Callable[[TensorDict], ModelOutputs]
    params: TensorDict | None = None
    padded_rows: bool = False  # the batch may hold padded rows (target IGNORE_TARGET): see ``row_mean``


def real_rows(target: Tensor, ctx: LossContext) -> Tensor | None:
    """The batch's real rows (bool ``[B]``: target not ``IGNORE_TARGET``) where it may hold padded rows, else None."""
    return (target != IGNORE_TARGET) if ctx.padded_rows else None


def row_mean(values: Tensor, target: Tensor, ctx: LossContext) -> Tensor:
    """The mean of per-row ``values`` ``[B, ...]`` over the batch's rows (all of them: ``values.mean()``), or over its
    real rows where it may hold padded ones (``ctx.padded_rows``; the same value to float tolerance)."""
    real = real_rows(target, ctx)
    if real is None:
        return values.mean()
    weight = real.reshape(-1, *[1] * (values.dim() - 1)).to(values.dtype)
    return (values * weight).sum() / (weight.sum() * values[0].numel()).clamp(min=1)


def total(terms: dict[str, Tensor]) -> Tensor:
    """The loss: the sum of the named terms, in their order."""
    return functools.reduce(operator.add, terms.values())


@dataclass(frozen=True)
class ClientLoss:
    """An algorithm's ``local_loss`` bound to a client (or to stacked clients) for a round."""

    algorithm: LossRule
    client: int | Tensor
    broadcast: Payload
    client_state: dict[str, TensorDict]
    info: RoundInfo
    label_counts: Tensor | None = None

    @property
    def features(self) -> bool:
        return bool(getattr(self.algorithm, "needs_features", False))

    def at(self, objective: ModelOutputsSource, params: TensorDict, batch: Any, padded_rows: bool = False) -> tuple[Tensor, dict[str, Tensor], Tensor, Tensor]:
        """``(loss, terms, logits, target)`` of one client at ``params`` on ``batch`` (``padded_rows``: it may hold
        masked stacking's padded rows, ``LossContext.padded_rows``)."""
        out, target = objective.outputs_at(model_tensors(objective, params), batch, self.features)
        terms = self._terms(objective, out, target, batch, self.client, self.client_state, self.label_counts, params, padded_rows)
        return total(terms), terms, out.logits, target

    def stacked(self, objective: ModelOutputsSource, params: TensorDict, batch: Any, padded_rows: bool = False) -> tuple[Tensor, dict[str, Tensor], Tensor, Tensor]:
        """``at`` for clients stacked on a leading dimension: the outputs by ``objective.stacked_outputs``
        (client rows or vmap), the loss per client under vmap; ``[S]`` losses and terms."""
        out, target = objective.stacked_outputs(model_tensors(objective, params), batch, self.features)

        def one(logits, features, target, batch, client, state, counts, params):
            terms = self._terms(objective, ModelOutputs(logits, features), target, batch, client, state, counts, params, padded_rows)
            return total(terms), terms

        args = (out.logits, out.features, target, batch, self.client, self.client_state, self.label_counts, params)
        loss, terms = vmap(one, in_dims=tuple(None if a is None else 0 for a in args), randomness="different")(*args)
        return loss, terms, out.logits, target

    def _terms(self, objective, out, target, batch, client, state, counts, params=None, padded_rows=False) -> dict[str, Tensor]:
        def evaluate(params: TensorDict) -> ModelOutputs:
            return objective.outputs_at(model_tensors(objective, params), batch, self.features)[0]

        ctx = LossContext(client, self.broadcast, state, self.info, counts, evaluate, params, padded_rows)
        terms = self.algorithm.local_loss(out, target, ctx)
        if not isinstance(terms, dict) or not terms:
            raise TypeError(f"{type(self.algorithm).__name__}.local_loss must return a non-empty dict of named loss terms")
        return terms


def model_tensors(objective: ModelOutputsSource, params: TensorDict) -> TensorDict:
    """The tensors of ``params`` that the model has (``params`` itself where all are): a local loss may be
    given other tensors too (``LossContext.params``), which it reads and the model does not."""
    slots = objective.swap.slots
    if all(k in slots for k in params):
        return params
    return {k: v for k, v in params.items() if k in slots}


def model_has_representation(model: Any) -> bool:
    """Whether the model follows the representation convention: ``representation(*inputs)`` and
    ``head(z)`` with ``forward(*inputs) == head(representation(*inputs))`` (docs/architecture.md)."""
    return callable(getattr(model, "representation", None)) and callable(getattr(model, "head", None))


def keeps_model_loss(method: Callable) -> Callable:
    """Marks the base class's placeholder ``local_loss``: an algorithm whose ``local_loss`` is the marked
    one keeps the model's own loss."""
    method.keeps_model_loss = True
    return method


def defines_local_loss(algorithm: object) -> bool:
    """Whether ``algorithm`` replaces the model's loss with its own ``local_loss``."""
    method = getattr(type(algorithm), "local_loss", None)
    return method is not None and not getattr(method, "keeps_model_loss", False)


def client_loss(
    algorithm: LossRule, clients: int | Tensor, broadcast: Payload, client_state: Any, info: RoundInfo, data: Any, device: Any
) -> ClientLoss | None:
    """The algorithm's local loss bound to ``clients`` (one id, or the stacked ids), or None where the
    algorithm keeps the model's loss. Label counts are read from the data only if the algorithm declares them."""
    if not defines_local_loss(algorithm):
        return None
    counts = None
    if getattr(algorithm, "needs_label_counts", False):
        if isinstance(clients, Tensor):
            counts = torch.stack([data.client_label_counts(int(c)) for c in clients.tolist()]).to(device)
        else:
            counts = data.client_label_counts(clients).to(device)
    return ClientLoss(algorithm, clients, broadcast, client_state, info, counts)


def check_local_loss(algorithm: LossRule, model: Any) -> None:
    """Before training: a loss that reads the representation needs a model that has one."""
    if defines_local_loss(algorithm) and getattr(algorithm, "needs_features", False) and not model_has_representation(model):
        raise ValueError(
            f"algorithm {type(algorithm).__name__} reads the model's representation, but {type(model).__name__} defines no "
            "representation(inputs) and head(z) (docs/architecture.md, 'The local objective'); use a model that does"
        )


def check_label_counts(algorithm: LossRule, data: Any) -> None:
    """Before training: a loss that reads the clients' label counts needs data that gives them."""
    needs = defines_local_loss(algorithm) and getattr(algorithm, "needs_label_counts", False)
    if needs and not callable(getattr(data, "client_label_counts", None)):
        raise ValueError(
            f"algorithm {type(algorithm).__name__} reads the clients' label counts, but the data {type(data).__name__} defines no "
            "client_label_counts(client_id) (fl_lightning/core/client_data.py); use a FederatedDataModule"
        )
