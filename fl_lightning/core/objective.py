"""The objective: a model's forward pass and loss on one batch, the only place the engine
calls a model. Training, batched training, evaluation and every callback use it.

A batch is ``(inputs..., target)`` or a dict with ``labels`` (Hugging Face style). The
loss is ``model.loss(outputs, target)`` if the model defines one, else cross-entropy,
plus ``output.penalty`` when the model's output carries one (a regularizer of the
parameters, computed in ``forward`` so that substituted parameters are penalised).
Outputs are a tensor of logits or an object with ``.logits``.

Clients stacked on a leading dimension (batched execution) are evaluated in one of two ways:
as *client rows* (``fl_lightning.core.client_rows``) for a model that declares ``independent_rows``
and whose substituted parameters lie in layers with a rule (Linear, Conv2d, GroupNorm): the
clients' batches concatenated into one batch through the shared model; or by ``vmap`` of the
forward (any model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from fl_lightning.core import params as P
from fl_lightning.core.client_data import IGNORE_TARGET, batch_targets
from fl_lightning.core.client_rows import ClientRows, UnsupportedLayer, model_declares
from fl_lightning.core.local_loss import ClientLoss, ModelOutputs
from fl_lightning.core.params import TensorDict
from fl_lightning.core.real_rows_norm import RealRowsNorm, batch_statistics_layers, real_rows

GradFn = Callable[[TensorDict], tuple[Tensor, TensorDict]]


class ParameterSwap:
    """Evaluate one model with some of its parameters replaced by given tensors.

    Equivalent to ``torch.func.functional_call`` for parameters, without its per-call
    bookkeeping (the slot of every name is resolved once): the round loop swaps
    parameters thousands of times per second.
    """

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.slots = {}
        for name in names:
            owner, _, attr = name.rpartition(".")
            self.slots[name] = (model.get_submodule(owner) if owner else model, attr)

    def __call__(self, params: TensorDict) -> _Swapped:
        """A context manager (a plain class: ``contextlib``'s generator costs more than the swap)."""
        return _Swapped(self.slots, params)


class _Swapped:
    __slots__ = ("slots", "params", "saved")

    def __init__(self, slots: dict, params: TensorDict) -> None:
        self.slots, self.params, self.saved = slots, params, []

    def __enter__(self) -> None:
        for name, tensor in self.params.items():
            module, attr = self.slots[name]
            self.saved.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = tensor

    def __exit__(self, *exc: object) -> None:
        for module, attr, original in self.saved:
            module._parameters[attr] = original
        self.saved.clear()


_UNIT_SEEDS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def loss_grads(loss: Tensor, leaves: list[Tensor]) -> tuple[Tensor, ...]:
    """``torch.autograd.grad(loss, leaves)``, minus its per-call Python checks.

    The autograd engine is called the way ``torch.autograd.grad`` calls it, with a cached
    unit seed: the wrapper's argument normalisation costs ~100 us per call, a quarter of a
    small model's whole step (benchmarks/run.py). Falls back to the public function if
    the engine entry point is missing.
    """
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None or loss.dim() != 0:
        return torch.autograd.grad(loss, leaves)
    key = (loss.dtype, loss.device)
    seed = _UNIT_SEEDS.get(key)
    if seed is None:
        seed = _UNIT_SEEDS[key] = torch.ones((), dtype=loss.dtype, device=loss.device)
    return engine.run_backward((loss,), (seed,), False, False, tuple(leaves), False, False)


class _NotPlainOutputs(Exception):
    """The model's forward returns more than logits (e.g. a penalty): its loss is taken under vmap."""


class Objective:
    """Forward and loss of ``model``, at its own parameters or at substituted ones.

    Args:
        model: the network.
        names: the parameters that may be substituted (``at``, ``grad_fn``, ``stacked``).
    """

    def __init__(self, model: nn.Module, names: Sequence[str] = ()) -> None:
        self.model = model
        self.swap = ParameterSwap(model, names)
        # Looked up once: ``nn.Module.__getattr__``'s miss is slow, and this runs every step.
        has_loss = hasattr(type(model), "loss") or "loss" in model.__dict__ or "loss" in model._modules
        self.custom_loss: Callable[[Tensor, Tensor], Tensor] | None = model.loss if has_loss else None
        self._plain_outputs = self.custom_loss is None  # logits + cross-entropy, until a forward says otherwise
        #: Per-token outputs (a language model): training records keep no per-sample accuracy.
        self.token_level = bool(getattr(model, "token_level", False))
        self.batch_norms = RealRowsNorm(batch_statistics_layers(model))  # over real rows where a batch holds padded rows
        self.rows: ClientRows | None = None  # stacked clients as rows of one batch (see the module docstring)
        if model_declares(model, "independent_rows"):
            try:
                self.rows = ClientRows(model, names)
            except UnsupportedLayer:
                pass  # a substituted tensor in a layer ClientRows has no rule for: clients are stacked by vmap

    def __call__(self, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(loss, outputs, target)`` of the model on ``batch``."""
        args, kwargs, target = _split(batch)
        raw = self._over_real_rows(target, self.model, *args, **kwargs)
        plain = type(raw) is Tensor
        out = raw if plain else getattr(raw, "logits", raw)
        loss = self.custom_loss(out, target) if self.custom_loss is not None else F.cross_entropy(out, target)
        penalty = None if plain else getattr(raw, "penalty", None)
        if penalty is not None:
            loss = loss + penalty
        return loss, out, target

    def _over_real_rows(self, target: Tensor, evaluate: Callable, *args: Any, **kwargs: Any) -> Any:
        """``evaluate(*args)``; while the batch-statistics BatchNorm layers' real-row hooks are installed (a stacked
        round with padded rows), with their statistics over the rows of ``target`` that are not padding (29.4)."""
        norms = self.batch_norms
        if not norms.installed:
            return evaluate(*args, **kwargs)
        norms.real = real_rows(target)
        try:
            return evaluate(*args, **kwargs)
        finally:
            norms.real = None

    def at(self, params: TensorDict, batch: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``self(batch)`` with ``params`` substituted for the model's parameters of those names."""
        with self.swap(params):
            return self(batch)

    def grad_fn(
        self, batch: Any, weight_decay: float, record: StepRecord | None = None, stacked: bool = False,
        loss: ClientLoss | None = None, functional: bool = False, padded_rows: bool = False,
    ) -> GradFn:
        """Loss and gradient of the minibatch loss plus ``weight_decay/2 ||w||^2`` at given parameters.

        ``stacked``: parameters and batch hold clients on a leading dimension; the loss is then
        ``[S]`` and the gradients ``[S, ...]``: clients are independent, so the gradient of the
        *sum* of their losses is every client's own gradient, from one ordinary backward.
        ``loss``: an algorithm's local loss (``fl_lightning.core.local_loss``) in place of the model's.
        The first evaluation (loss without the decay term, its terms, outputs, targets) goes to ``record``.
        ``functional``: the gradient by ``torch.func.grad_and_value`` instead of the autograd engine,
        so that ``torch.compile`` and ``vmap`` can trace it (compiled execution); the same values.
        ``padded_rows``: the stacked batch holds padded rows (target ``IGNORE_TARGET``, masked stacking):
        each client's loss is the mean over its real rows.
        """
        local_loss = None if loss is None else (loss.stacked if stacked else loss.at)

        def evaluate(params: TensorDict) -> tuple[Tensor, tuple[Tensor, dict[str, Tensor] | None, Tensor, Tensor]]:
            if local_loss is None:
                value, out, target = self.stacked(params, batch, padded_rows) if stacked else self.at(params, batch)
                terms = None
            else:
                value, terms, out, target = local_loss(self, params, batch, padded_rows)
            return (value.sum() if stacked else value), (value, terms if terms is not None else {}, out, target)  # aux: tensors only

        def grad(params: TensorDict) -> tuple[Tensor, TensorDict]:
            if functional:
                grads, (_, (value, terms, out, target)) = grad_and_value(evaluate, has_aux=True)(params)
            else:
                leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
                total, (value, terms, out, target) = evaluate(leaves)
                grads = dict(zip(leaves, loss_grads(total, list(leaves.values()))))
            terms = terms or None
            if weight_decay:
                grads = P.add(grads, params, weight_decay)
            value = value.detach()
            if record is not None and not grad.recorded:  # the step's first evaluation is its reported one
                record.add(value, None if self.token_level else out, target, terms)
                grad.recorded = True
            return value, grads

        grad.recorded = False
        return grad

    # ---- outputs for a local loss (fl_lightning.core.local_loss) ---------------------------------------
    def outputs(self, batch: Any, features: bool = False) -> tuple[ModelOutputs, Tensor]:
        """The model's outputs on ``batch`` (with its representation where ``features``) and the target."""
        args, kwargs, target = _split(batch)
        if features:  # the representation convention: forward = head(representation(inputs))
            z = self._over_real_rows(target, self.model.representation, *args, **kwargs)
            return ModelOutputs(self.model.head(z), z), target
        raw = self._over_real_rows(target, self.model, *args, **kwargs)
        if type(raw) is Tensor:
            return ModelOutputs(raw), target
        if getattr(raw, "penalty", None) is not None:
            raise ValueError("the model's output carries a penalty, which an algorithm's local_loss would leave out; use another model")
        return ModelOutputs(getattr(raw, "logits", raw)), target

    def outputs_at(self, params: TensorDict, batch: Any, features: bool = False) -> tuple[ModelOutputs, Tensor]:
        """``outputs`` with ``params`` substituted for the model's parameters of those names."""
        with self.swap(params):
            return self.outputs(batch, features)

    def stacked_outputs(self, params: TensorDict, batch: Any, features: bool = False) -> tuple[ModelOutputs, Tensor]:
        """``outputs`` of clients stacked on a leading dimension (``[S, B, ...]``): as client rows
        where the model allows (``ClientRows``), else by vmap of the forward."""
        if self.rows is not None:
            flat = {k: v.flatten(0, 1) for k, v in batch.items()} if isinstance(batch, dict) else [x.flatten(0, 1) for x in batch]
            with self.rows(params):
                out, target = self.outputs(flat, features)
            shape = batch_targets(batch).shape
            z = None if out.features is None else out.features.view(*shape, *out.features.shape[1:])
            return ModelOutputs(out.logits.view(*shape, *out.logits.shape[1:]), z), target.view(shape)

        def one(p: TensorDict, b: Any) -> tuple[Tensor, ...]:
            out, target = self.outputs_at(p, b, features)
            return (out.logits, target, out.features) if features else (out.logits, target)

        logits, target, *z = vmap(one, randomness="different")(params, batch)
        return ModelOutputs(logits, z[0] if z else None), target

    # ---- clients stacked on a leading dimension ------------------------------------------------
    def stacked(self, params: TensorDict, batch: Any, padded_rows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``([S] losses, outputs, targets)``: client i's at ``params[.][i]`` on ``batch[.][i]``.
        ``padded_rows``: rows with target ``IGNORE_TARGET`` are padding; a client's loss is the mean over the others.

        Plain logits are computed by one ``vmap`` of the forward and cross-entropy runs
        outside it (one kernel for all clients); other models' whole objective runs under vmap.
        """
        if self.batch_norms.installed:  # batch statistics over each client's real rows: read from its own targets
            return vmap(self.at, randomness="different")(params, batch)
        if self.rows is not None and (self._plain_outputs or self.custom_loss is not None):
            try:
                return self._as_rows(params, batch, padded_rows)
            except _NotPlainOutputs:
                self.rows, self._plain_outputs = None, False
        if self._plain_outputs and not isinstance(batch, dict):
            *inputs, target = batch

            def outputs_at(p: TensorDict, *x: Tensor) -> Tensor:
                with self.swap(p):
                    out = self.model(*x)
                if not isinstance(out, Tensor):
                    raise _NotPlainOutputs
                return out

            try:
                out = vmap(outputs_at, randomness="different")(params, *inputs)
            except _NotPlainOutputs:
                self._plain_outputs = False
            else:
                if out.dim() == 3 and target.dim() == 2 and not target.is_floating_point():
                    per_sample = F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="none")
                    return _row_mean(per_sample.view(target.shape), target, padded_rows), out, target
                return vmap(F.cross_entropy)(out, target), out, target

        return vmap(self.at, randomness="different")(params, batch)

    def _as_rows(self, params: TensorDict, batch: Any, padded_rows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``stacked`` by one forward over the clients' concatenated batches (``ClientRows``)."""
        if isinstance(batch, dict):
            target = batch["labels"]
            with self.rows(params):
                raw = self.model(**{k: v.flatten(0, 1) for k, v in batch.items() if k != "labels"})
        else:
            *inputs, target = batch
            with self.rows(params):
                raw = self.model(*(x.flatten(0, 1) for x in inputs))
        out = raw if type(raw) is Tensor else getattr(raw, "logits", None)
        if out is None or getattr(raw, "penalty", None) is not None:
            raise _NotPlainOutputs
        if self.custom_loss is not None:  # the model's own loss, per client on its rows
            # A loop over the S clients, not vmap: vmap's backward of a language model's gather over the
            # vocabulary cost 1.7x the whole step (tiny GPT-2, S = 5).
            out = out.view(*target.shape[:2], *out.shape[1:])
            return torch.stack([self.custom_loss(o, t) for o, t in zip(out, target)]), out, target
        per_sample = F.cross_entropy(out, target.flatten(), reduction="none")
        return _row_mean(per_sample.view(target.shape), target, padded_rows), out.view(*target.shape, *out.shape[1:]), target


def _split(batch: Any) -> tuple[tuple, dict[str, Any], Tensor]:
    """``(positional inputs, keyword inputs, target)`` of a tuple batch ``(inputs..., target)`` or a dict batch with ``labels``."""
    if isinstance(batch, dict):
        return (), {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    return tuple(batch[:-1]), {}, batch[-1]


def _row_mean(per_sample: Tensor, target: Tensor, padded_rows: bool) -> Tensor:
    """Each client's mean loss over its rows ``[S, B] -> [S]``; with ``padded_rows`` over its real rows only
    (cross-entropy gives a padded row, target ``IGNORE_TARGET``, a loss of exactly 0)."""
    if not padded_rows:
        return per_sample.mean(1)
    return per_sample.sum(1) / (target != IGNORE_TARGET).sum(1).clamp(min=1)


class StepRecord:
    """Each local step's first evaluation: its loss, and its outputs and targets for the accuracy.

    Tensors are kept as they are and read once when the client (or the round's stacked
    clients) is done, so the local steps never wait for the host.
    """

    __slots__ = ("losses", "outputs", "targets", "terms")

    def __init__(self) -> None:
        self.losses: list[Tensor] = []
        self.outputs: list[Tensor] | None = []  # None: the model is not a classifier (decided at the first step)
        self.targets: list[Tensor] = []
        self.terms: list[dict[str, Tensor]] = []  # an algorithm's named loss terms, per step (``local_loss``)

    def add(self, loss: Tensor, out: Tensor, target: Tensor, terms: dict[str, Tensor] | None = None) -> None:
        self.losses.append(loss)
        if terms is not None:
            self.terms.append({k: v.detach() for k, v in terms.items()})
        outputs = self.outputs
        if outputs is None:
            return
        if not outputs and not (
            isinstance(out, Tensor) and out.dim() >= 2 and out.shape[-1] > 1
            and not target.is_floating_point() and target.shape == out.shape[:-1]
        ):  # fmt: skip
            self.outputs = None
            return
        outputs.append(out.detach())
        self.targets.append(target)

    def correct(self) -> Tensor | None:
        """Correct predictions over every recorded step's samples (``[]``, or ``[S]`` for stacked clients)."""
        if not self.outputs:
            return None
        out, target = torch.cat(self.outputs, dim=-2), torch.cat(self.targets, dim=-1)  # the steps' samples side by side
        return (predicted(out) == target).sum(-1)

    def samples(self) -> int:
        return sum(t.shape[-1] for t in self.targets)

    def term_means(self) -> dict[str, float] | dict[str, list[float]]:
        """The mean over steps of each named loss term: ``{term: mean}``, or for stacked clients
        ``{term: [each client's mean]}`` ({} where the loss has no named terms)."""
        if not self.terms:
            return {}
        means = {k: torch.stack([t[k] for t in self.terms]).mean(0) for k in self.terms[0]}
        if next(iter(means.values())).dim() == 0:
            return {k: float(v) for k, v in means.items()}
        return {k: v.tolist() for k, v in means.items()}


def predicted(out: Tensor) -> Tensor:
    """The predicted class of each row of logits: ``out.argmax(-1)``, the first maximal entry (NaN counts as maximal).

    ``max(-1).indices`` gives the same indices at a third to two thirds of argmax's cost on CPU for a short last
    dimension (argmax over it is the slowest op of a round's accuracy)."""
    return out.max(-1).indices


def round_means(records: Sequence[StepRecord]) -> list[tuple[float, float]]:
    """Every client's (mean step loss, accuracy) from its record, for all clients of a round at once:
    a handful of ops and one host sync per round, not per client. NaN where nothing was recorded
    (no loss: e.g. SVRG's full-gradient steps; no accuracy: not a classifier)."""
    losses = [loss for record in records for loss in record.losses]
    values = iter(torch.stack(losses).tolist() if losses else [])
    means = []
    for record in records:
        client = [next(values) for _ in record.losses]
        means.append(sum(client) / len(client) if client else math.nan)
    scored = [r for r in records if r.outputs]
    if not scored:
        return [(m, math.nan) for m in means]
    out = torch.cat([o for r in scored for o in r.outputs])
    target = torch.cat([t for r in scored for t in r.targets])
    counts = [r.samples() for r in scored]
    ends = torch.tensor(counts).cumsum(0) - 1
    cumulative = [0, *(predicted(out) == target).cumsum(0)[ends].tolist()]
    fractions = iter([(cumulative[i + 1] - cumulative[i]) / n for i, n in enumerate(counts)])  # the scored records, in order
    return [(m, next(fractions) if r.outputs else math.nan) for m, r in zip(means, records)]
