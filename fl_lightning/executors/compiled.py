"""Compiled client execution: a client's local steps (or the stacked clients') as compiled programs.

The program is the algorithm's rule as eager execution runs it (``client_init``, then K times
``ctx.grad`` and ``client_step``), with the gradient taken by ``Objective.grad_fn(...,
functional=True)`` so that ``torch.compile`` (inductor) traces the objective's forward, its loss
and their gradient together with the rule into one graph. Stacked clients run the same program
under ``vmap``. An algorithm's ``local_loss`` (MOON, FedNTD, FedLC, FedRS, FedDecorr) is traced with
the rest. ``client_finish`` stays eager (once a round, and it may read ``ctx.client_id``).

The compiled unit (``compile_unit``) is ``"auto"`` (batched execution's default: the round program for rounds
whose clients all run ``local.steps`` steps of ``local.batch_size``, the step program for masked stacking's
rounds of unequal work, so that one program serves every K; sequential execution: the round program) or

- ``"round"``: ``client_init`` and the K steps unrolled into one program (``local_steps``): the
  fewest calls, but tracing and code generation grow with K;
- ``"step"``: one local step is the program (``one_step``: ``ctx.grad`` and ``client_step`` on the
  step's batch), called K times; ``client_init`` runs eagerly (under ``vmap`` for stacked clients).
  About half the round program's compile time on the quickstart (K = 10), but K calls a client,
  each paying dynamo's entry (slower rounds on small models). The step index is not an input:
  a ``client_step`` that reads ``ctx.step`` or ``ctx.num_steps`` (FedAlt's schedule) would make it a
  constant of the graph, one program per step, so ``StepIndexUnavailable`` is raised while tracing and
  that rule's clients run the round program instead (a declared reason, logged once). With ``steps_per_call=2``
  two consecutive steps of the same shape (stacked clients of a masked round: the same stack size; one client's
  ``local.epochs``: the same batch shape) run as one call of the pair program (``stacked_two_steps``,
  ``two_steps``, ``pair_steps``) where ``max_variants`` leaves room for both variants: half the calls, for about
  twice the compile time.

Compiled variants are keyed by what the graph depends on, and bounded:

- K (stragglers run fewer steps): one round program per distinct number of local steps; the step
  program does not depend on K (one program serves every straggler);
- the batch shape: a client with fewer samples than ``local.batch_size`` trains on its whole
  set; such short batches share one variant with a dynamic batch dimension;
- S (batched): the number of stacked clients is padded up to a power of two, but at most to the
  fixed number of clients a round samples (``UniformSampling``), so a round without dropouts runs
  unpadded (the padding repeats the last client and is discarded; ``batched.padded_clients``):
  dropout uses at most log2(S) + 2 variants, Bernoulli participation log2(S) + 1. A masked round's step
  program shrinks the stack as its clients finish (clients in decreasing K; ``masking.stack_sizes``): the
  ladder of sizes (the first, then each power of two below it) is compiled at the first such round.

A run that would need more than ``max_variants`` variants runs eagerly from then on (a
declared, logged reason). The variant chosen depends only on the round's shapes, never on
what was compiled before, so a resumed run uses the same programs as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor
from torch.fx.experimental import _config as fx_config

from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientIdUnavailable, RoundInfo
from fl_lightning.core.errors import FLError, one_line
from fl_lightning.core.local_loss import ClientLoss, defines_local_loss
from fl_lightning.core.objective import Objective
from fl_lightning.core.params import TensorDict
from fl_lightning.executors import masking as M
from fl_lightning.executors.masking import keep_where

log = logging.getLogger(__name__)

DEFAULT_MAX_VARIANTS = 16


class Uncompilable(Exception):
    """A declared reason to run eagerly instead of compiled (the message says which)."""


class CompileError(FLError, RuntimeError):
    """Compilation failed for a reason other than a rule or model that cannot be traced."""


class StepIndexUnavailable(Uncompilable):
    """A ``client_step`` read ``ctx.step`` or ``ctx.num_steps`` inside the per-step program (the message says which)."""


class _StepContext(ClientContext):
    """The context of the per-step program: ``step`` and ``num_steps`` are not inputs of the graph
    (a Python number there would be a constant: one program per step), so reading them raises
    ``StepIndexUnavailable`` (the rule then runs the round program)."""

    @property
    def step(self) -> int:
        raise StepIndexUnavailable(self._unavailable("ctx.step"))

    @step.setter
    def step(self, value: int) -> None:
        pass  # set by ClientContext's __init__; never read

    @property
    def num_steps(self) -> int:
        raise StepIndexUnavailable(self._unavailable("ctx.num_steps"))

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        pass

    def _unavailable(self, name: str) -> str:
        return f"client_step reads {name}, which the per-step program (compile_unit: step) does not take; its K steps run as one unrolled program"


class _Recorder:
    """The ``record`` of ``grad_fn`` inside the program: every step's first evaluation, returned as outputs."""

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    def add(self, loss: Tensor, out: Tensor | None, target: Tensor, terms: dict[str, Tensor] | None = None) -> None:
        self.items.append((loss, out, target, terms or {}))  # terms: an algorithm's local_loss terms ({}: none; vmap returns no None)


class _MaskedStepsContext(ClientContext):
    """The context of stacked clients padded to one K (masked stacking): ``num_steps`` is not each client's."""

    @property
    def num_steps(self) -> int:
        raise Uncompilable("client_step reads ctx.num_steps, which differs between the stacked clients of a padded round")

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        pass


def _advance(step_mask: Tensor | None, new: tuple, old: tuple) -> tuple:
    """``new`` (parameters, local state), or ``old`` where the client's step is padding (``step_mask`` False)."""
    return new if step_mask is None else keep_where(step_mask, new, old)


def _no_full_grad(params: TensorDict) -> TensorDict:
    raise Uncompilable("full local gradients read the client's whole training set, whose size differs by client")


def local_steps(
    algorithm: Algorithm, objective: Objective, weight_decay: float, params: TensorDict, client_state: Any, client: Any,
    info: RoundInfo, broadcast: Any, personal: TensorDict, batches: Sequence[Any], label_counts: Tensor | None = None,
    step_mask: Tensor | None = None,
) -> tuple[TensorDict, Any, list]:
    """One client's ``client_init`` and K local steps (K = ``len(batches)``): the traced program.
    ``step_mask`` (bool ``[K]``, masked stacking): a False step leaves parameters and local state as they were.

    An algorithm's ``local_loss`` (``fl_lightning.core.local_loss``) is traced with the rest, bound to the
    client as eager execution binds it (``label_counts``: the client's, where the algorithm reads them).
    Returns the parameters, the local state and each step's first evaluation (loss, outputs, targets,
    the local loss's terms: {} for the model's own loss).
    """
    context = ClientContext if step_mask is None else _MaskedStepsContext
    ctx = context(client, broadcast, client_state, info, len(batches), full_grad=_no_full_grad, personal=personal)
    loss = ClientLoss(algorithm, client, broadcast, client_state, info, label_counts) if defines_local_loss(algorithm) else None
    local = algorithm.client_init(params, ctx)
    records: list = []
    for step, batch in enumerate(batches):
        ctx.step = step
        ctx.grad = objective.grad_fn(batch, weight_decay, _Recorder(records), functional=True, loss=loss, padded_rows=step_mask is not None)
        new = algorithm.client_step(params, local, ctx)
        params, local = _advance(None if step_mask is None else step_mask[step], new, (params, local))
    return params, local, records


def stacked_local_steps(algorithm, objective, weight_decay, params, client_state, clients, info, broadcast, personal, batches,
                        label_counts=None, step_mask=None):  # fmt: skip
    """``local_steps`` of stacked clients (a leading client dimension on params, state, ids, batches, label counts, step mask)."""

    def one(p, state, cid, b, counts, own, mask):
        return local_steps(algorithm, objective, weight_decay, p, state, cid, info, broadcast, own, b, counts, mask)

    in_dims = (0, 0, 0, 0, None if label_counts is None else 0, 0, None if step_mask is None else 0)  # personal tensors: each client's own
    return torch.func.vmap(one, in_dims=in_dims, randomness="different")(params, client_state, clients, batches, label_counts, personal, step_mask)


def init_state(algorithm: Algorithm, params: TensorDict, client_state: Any, client: Any, info: RoundInfo, broadcast: Any,
               personal: TensorDict, num_steps: int, masked: bool = False) -> Any:  # fmt: skip
    """One client's ``client_init`` as the round program runs it (the client's id a tensor), eagerly: the step unit's first part."""
    context = _MaskedStepsContext if masked else ClientContext
    ctx = context(client, broadcast, client_state, info, num_steps, full_grad=_no_full_grad, personal=personal)
    return algorithm.client_init(params, ctx)


def stacked_init_state(algorithm, params, client_state, clients, info, broadcast, personal, num_steps, masked=False):  # fmt: skip
    """``init_state`` of stacked clients, under ``vmap`` as the stacked round program runs it."""

    def one(p, state, cid, own):
        return init_state(algorithm, p, state, cid, info, broadcast, own, num_steps, masked)

    return torch.func.vmap(one, randomness="different")(params, client_state, clients, personal)


def one_step(
    algorithm: Algorithm, objective: Objective, weight_decay: float, params: TensorDict, local: Any, client_state: Any, client: Any,
    info: RoundInfo, broadcast: Any, personal: TensorDict, batch: Any, label_counts: Tensor | None = None, step_mask: Tensor | None = None,
) -> tuple[TensorDict, Any, list]:
    """One local step (``ctx.grad`` on ``batch`` and ``client_step``): the per-step program (``compile_unit: step``).

    The step index and K are not inputs (``_StepContext``). Returns the parameters, the local state and the
    step's first evaluation as ``local_steps`` returns them (a list: empty where the step takes no gradient).
    """
    ctx = _StepContext(client, broadcast, client_state, info, 0, full_grad=_no_full_grad, personal=personal)
    loss = ClientLoss(algorithm, client, broadcast, client_state, info, label_counts) if defines_local_loss(algorithm) else None
    records: list = []
    ctx.grad = objective.grad_fn(batch, weight_decay, _Recorder(records), functional=True, loss=loss, padded_rows=step_mask is not None)
    new = algorithm.client_step(params, local, ctx)
    params, local = _advance(step_mask, new, (params, local))
    return params, local, records


def stacked_one_step(algorithm, objective, weight_decay, params, local, client_state, clients, info, broadcast, personal, batch,
                     label_counts=None, step_mask=None):  # fmt: skip
    """``one_step`` of stacked clients (a leading client dimension on params, local and client state, ids, the batch, label counts, step mask)."""

    def one(p, loc, state, cid, b, counts, own, mask):
        return one_step(algorithm, objective, weight_decay, p, loc, state, cid, info, broadcast, own, b, counts, mask)

    in_dims = (0, 0, 0, 0, 0, None if label_counts is None else 0, 0, None if step_mask is None else 0)
    return torch.func.vmap(one, in_dims=in_dims, randomness="different")(
        params, local, client_state, clients, batch, label_counts, personal, step_mask
    )


def stacked_two_steps(algorithm, objective, weight_decay, params, local, client_state, clients, info, broadcast, personal, batches,
                      label_counts=None, step_masks=None):  # fmt: skip
    """Two consecutive ``stacked_one_step`` of the same stack (``batches``, ``step_masks``: the two steps'), one program:
    the pair program, which halves the calls (each pays dynamo's and AOT's entry) of a masked round's steps."""
    return _two(stacked_one_step, algorithm, objective, weight_decay, params, local, client_state, clients, info, broadcast, personal,
                batches, label_counts, step_masks)  # fmt: skip


def two_steps(algorithm, objective, weight_decay, params, local, client_state, client, info, broadcast, personal, batches,
              label_counts=None, step_masks=None):  # fmt: skip
    """Two consecutive ``one_step`` of one client (``local.epochs``: two batches of the same shape), one program."""
    return _two(one_step, algorithm, objective, weight_decay, params, local, client_state, client, info, broadcast, personal,
                batches, label_counts, step_masks)  # fmt: skip


def _two(step_fn, algorithm, objective, weight_decay, params, local, client_state, client, info, broadcast, personal, batches,
         label_counts, step_masks):  # fmt: skip
    records: list = []
    for batch, mask in zip(batches, step_masks or (None, None)):
        params, local, evaluations = step_fn(
            algorithm, objective, weight_decay, params, local, client_state, client, info, broadcast, personal, batch, label_counts, mask
        )
        records += evaluations
    return params, local, records


def check_steps_per_call(steps_per_call: Any) -> int:
    """``steps_per_call`` if it is 1 or 2, else a one-line ``ValueError``."""
    if type(steps_per_call) is not int or steps_per_call not in (1, 2):
        raise ValueError(f"execution.steps_per_call must be 1 or 2, got {steps_per_call!r}")
    return steps_per_call


def pair_steps(sizes: Sequence[int] | None, steps: int, k: int) -> bool:
    """Whether steps k and k + 1 of a stacked step-unit round run as one pair program: both exist and run the same
    stack (``sizes``: a shrinking stack's size at each step; None: one size throughout)."""
    return k + 1 < steps and (sizes is None or sizes[k + 1] == sizes[k])


def _fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object: dynamo keeps compiled variants (and counts them
    against its recompile limit) per code object, so each executor's programs stay its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _is_untraceable(error: BaseException) -> bool:
    """Whether ``error`` says the rule or model cannot be traced (dynamo's graph breaks, data-dependent
    control flow), as opposed to a failure of the compiler itself (code generation, a C++ toolchain)."""
    from torch._dynamo import exc

    if isinstance(error, exc.Unsupported | exc.UserError | exc.FailOnRecompileLimitHit):
        return True
    return type(error).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


COMPILE_UNITS = ("auto", "step", "round")


def check_compile_unit(unit: str) -> str:
    """``unit`` if it is a compiled unit (``COMPILE_UNITS``), else a one-line ``ValueError``."""
    if unit not in COMPILE_UNITS:
        raise ValueError(f"execution.compile_unit must be one of {list(COMPILE_UNITS)}, got {unit!r}")
    return unit


class CompiledPrograms:
    """The compiled local-step programs of one executor, their variants and compile time.

    Args:
        stacked: clients stacked on a leading dimension (batched execution) or one client at a time.
        max_variants: the most compiled variants; beyond it execution is eager (declared).
        backend: ``torch.compile``'s backend (``inductor``; ``aot_eager`` traces without generating code).
        unit: ``"step"`` (one local step a program, called K times) or ``"round"`` (the K steps unrolled
            into one program); see the module docstring. ``"auto"``: ``"round"`` unless a call names its unit.
        steps_per_call: 2: the step unit's consecutive steps of the same shape two a call (the pair program).
    """

    def __init__(self, stacked: bool, max_variants: int = DEFAULT_MAX_VARIANTS, backend: str = "inductor", unit: str = "round",
                 steps_per_call: int = 1) -> None:  # fmt: skip
        self.stacked, self.max_variants, self.backend, self.steps_per_call = stacked, max_variants, backend, steps_per_call
        self.unit = "round" if unit == "auto" else unit  # "auto": the caller names the unit of each call (batched execution)
        self._chosen_unit = unit
        self.step_unavailable = False  # a rule read the step index in the step program: every call runs the round program
        self.compile_seconds = 0.0
        self.compiled = 0  # graphs compiled (the variants actually built)
        self.variants: set[tuple] = set()  # the keys run so far
        self.disabled: str | None = None  # the declared reason execution went eager for good
        self.unit_fallbacks: Counter[str] = Counter()  # clients run by the round program instead of the step's, by reason
        self._disabled_error: BaseException | None = None  # the declared error to raise again, if one was traced
        self._round_fn = stacked_local_steps if stacked else local_steps
        self._step_fn = stacked_one_step if stacked else one_step
        self._pair_fn = stacked_two_steps if stacked else two_steps  # ``steps_per_call=2``: two steps a call
        self._programs = {
            (unit_fn, dynamic): torch.compile(_fresh(unit_fn), fullgraph=True, dynamic=dynamic, backend=backend)
            for unit_fn in (self._round_fn, self._step_fn, self._pair_fn) for dynamic in (False, True)
        }  # fmt: skip  (dynamo traces a program at its first call: a unit not run costs nothing)
        # dynamo's settings while a program runs (and may compile), made once: building the patch costs
        # ~1 ms (a copy of dynamo's whole config), entering it ~15 us
        self._config = torch._dynamo.config.patch(
            recompile_limit=max_variants, fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False,
            automatic_dynamic_local_pgo=False,
        )  # fmt: skip
        # No duck shaping: a dynamic batch size that happens to equal a parameter's dimension would be traced as that
        # dimension, and the next batch size recompile the program (``train_client_compiled``'s short batches)
        self._shape_config = fx_config.patch(use_duck_shape=False)
        self._inductor_config: Any = None  # inductor's settings (``_inductor_settings``), made at the first run

    @property
    def step_unit_available(self) -> bool:
        """Whether a call may run the step program (``compile_unit`` auto or step, and the rule does not read the step index)."""
        return self._chosen_unit in ("auto", "step") and not self.step_unavailable

    def __call__(self, key: tuple, dynamic: bool | list[bool], *args: Any, unit: str | None = None, sizes: list[int] | None = None) -> tuple[TensorDict, Any, list]:
        """Run the client's (or stacked clients') local steps as variant ``key`` = (K, shapes...) of the
        compiled unit (``unit``, else this object's; compiling it the first time; the step unit's key drops K);
        ``Uncompilable`` for a declared reason to run eagerly, ``CompileError`` (one line) for any other compile failure.
        ``sizes`` (stacked step unit, clients in decreasing K): the stack's size at each step (``masking.stack_sizes``),
        one variant per size. ``dynamic`` a list (step unit, one client's ``local.epochs``): each step's batch on the
        static or the dynamic variant (a pass's short last batch)."""
        if (unit or self.unit) == "step" and not self.step_unavailable:
            rng = torch.random.get_rng_state()
            try:
                return self._run(("step", *key[1:]), dynamic, args, sizes)
            except StepIndexUnavailable as error:
                self.unit, self.step_unavailable = "round", True  # for good: the rule reads the step index in every round
                log_fallback(self.unit_fallbacks, f"{type(args[0]).__name__}'s {error}", log, to="the unrolled round program")
                torch.random.set_rng_state(rng)  # client_init ran eagerly: the round program draws again
        return self._run(key, dynamic, args)

    def _run(self, key: tuple, dynamic: bool, args: tuple, sizes: list[int] | None = None) -> tuple[TensorDict, Any, list]:
        """Variant ``key`` of the unit its first element names ("step", else the round's K), counted and timed
        (a shrinking stack's ``sizes``: one step variant per size)."""
        if self.disabled:
            raise self._disabled_error or Uncompilable(self.disabled)
        shrinking = sizes is not None and key[0] == "step" and len(set(sizes)) > 1
        # vmap's batch size is a constant of the traced graph: one program per stack size, the whole ladder (the
        # first size, then every power of two below it) compiled at its first round, whatever that round's sizes
        ladder = [sizes[0], *(1 << j for j in reversed(range((sizes[0] - 1).bit_length())))] if shrinking else []
        keys = [(key[0], size, *key[2:]) for size in ladder] if shrinking else [key]
        if isinstance(dynamic, list):
            keys = [(key[0], flag, *key[2:]) for flag in dict.fromkeys(dynamic)] if key[0] == "step" else [key]
            dynamic = dynamic if key[0] == "step" else any(dynamic)
        # ``steps_per_call=2``: two consecutive steps of the same shape (a stacked round's stack size, a client's batch
        # shape) as one call of the pair program, beside each step program, where ``max_variants`` leaves room for both
        # (decided by the round's shapes alone)
        pairs = (self.steps_per_call == 2 and key[0] == "step" and (sizes is not None if self.stacked else isinstance(dynamic, list))
                 and 2 * len(keys) <= self.max_variants - 2)  # fmt: skip
        if pairs:
            keys += [("pair", *k[1:]) for k in keys]
        fresh = [k for k in keys if k not in self.variants]
        if fresh and len(self.variants) + len(fresh) > self.max_variants:
            self.disabled = f"more than execution.max_variants = {self.max_variants} compiled variants would be needed"
            raise Uncompilable(self.disabled)
        new = bool(fresh)
        started, graphs = time.perf_counter(), _graphs_compiled()
        if self._inductor_config is None:
            self._inductor_config = _inductor_settings(self.backend)
        with self._config, self._shape_config, self._inductor_config:
            if shrinking and fresh:
                self._warm(dynamic, args, [k[1] for k in fresh if k[0] == "step"], [k[1] for k in fresh if k[0] == "pair"])
            out = self._steps(dynamic, new, args, sizes if shrinking else None, pairs) if key[0] == "step" else self._guarded(self._round_fn, dynamic, new, args)
        self.variants.update(keys)
        compiled = _graphs_compiled() - graphs
        if compiled:
            self.compiled += compiled
            self.compile_seconds += time.perf_counter() - started
        return out

    def _steps(self, dynamic: bool, new: bool, args: tuple, sizes: list[int] | None = None, pairs: bool = False) -> tuple[TensorDict, Any, list]:
        """The step unit: ``client_init`` eagerly, then the per-step program once per batch (``pairs``: the pair
        program once per two consecutive batches of the same stack, ``pair_steps``). With ``sizes`` (stacked
        clients in decreasing K) step k runs the first ``sizes[k]`` clients only: the others are done, their final
        tensors set aside (views, no copy) and joined back once; the step's evaluations are of its clients only."""
        algorithm, objective, weight_decay, params, client_state, client, info, broadcast, personal, batches, counts, *rest = args
        step_mask = rest[0] if rest else None  # masked stacking: bool [S, K]
        init = stacked_init_state if self.stacked else init_state
        local = init(algorithm, params, client_state, client, info, broadcast, personal, len(batches), step_mask is not None)
        records: list = []
        columns = None if step_mask is None else step_mask.t().contiguous()  # step k's mask contiguous: one program for every K
        stack = None if sizes is None else M.ShrinkingStack(sizes, len(client))
        batches, k = list(batches), 0
        while k < len(batches):
            two = pairs and pair_steps(sizes, len(batches), k) and (not isinstance(dynamic, list) or dynamic[k] == dynamic[k + 1])
            taken = [k, k + 1] if two else [k]
            batch, mask = [batches[j] for j in taken], [None if columns is None else columns[j] for j in taken]
            shape_free = dynamic[k] if isinstance(dynamic, list) else dynamic
            if stack is not None:
                cut = stack.shrink(k, (params, local), (client_state, client, personal, counts))
                if cut is not None:
                    (params, local), (client_state, client, personal, counts) = cut
                batch, mask = stack.rows((batch, mask))
            if two:
                unit_fn, batch, mask = self._pair_fn, tuple(batch), None if columns is None else tuple(mask)
            else:
                unit_fn, batch, mask = self._step_fn, batch[0], mask[0]
            step_args = (algorithm, objective, weight_decay, params, local, client_state, client, info, broadcast, personal, batch, counts, mask)
            params, local, evaluations = self._guarded(unit_fn, shape_free, new, step_args)
            records += evaluations  # of the first ``current`` clients
            k += len(taken)
        if stack is not None:
            params, local = stack.joined((params, local))
        return params, local, records

    def _warm(self, dynamic: bool, args: tuple, sizes: list[int], pair_sizes: Sequence[int] = ()) -> None:
        """Compile the step program for each stack size of ``sizes`` (and the pair program for each of ``pair_sizes``)
        by running the first step (two) on that many of the stacked clients (results discarded, the random state
        restored): a round's shrinking then never compiles."""
        algorithm, objective, weight_decay, params, client_state, client, info, broadcast, personal, batches, counts, step_mask = args
        with torch.random.fork_rng(devices=[]):
            local = stacked_init_state(algorithm, params, client_state, client, info, broadcast, personal, len(batches), True)
            mask = step_mask[:, 0].contiguous()
            runs = [(self._step_fn, size, (batches[0], mask)) for size in sizes]  # (a shrinking round has >= 2 steps)
            runs += [(self._pair_fn, size, (tuple(batches[:2]), (mask, mask))) for size in pair_sizes]
            for unit_fn, size, (batch, m) in runs:
                p, loc, state, ids, own, batch, cnt, m = M.leading_rows((params, local, client_state, client, personal, batch, counts, m), 0, size)
                self._guarded(unit_fn, dynamic, True, (algorithm, objective, weight_decay, p, loc, state, ids, info, broadcast, own, batch, cnt, m))

    def _guarded(self, unit_fn: Callable, dynamic: bool, new: bool, args: tuple) -> Any:
        """``unit_fn``'s compiled program on ``args``, its failures sorted into declared reasons and ``CompileError``."""
        try:
            return self._programs[unit_fn, dynamic](*args)
        except (Uncompilable, ClientIdUnavailable, FLError, ValueError):
            raise
        except Exception as error:
            cause = _declared_cause(error)
            if cause is not None:
                raise cause from error
            if _is_untraceable(error):
                declared = _eager_error(unit_fn, args)  # a declared error raised while tracing: dynamo reports it only as observed
                if isinstance(declared, StepIndexUnavailable):  # the round program may still compile
                    raise declared from error
                if isinstance(declared, Uncompilable | ClientIdUnavailable):  # for good: this rule never traces
                    self.disabled, self._disabled_error = str(declared), declared
                if declared is not None:
                    raise declared from error
                self.disabled = f"the rule or model cannot be compiled: {one_line(error)}"
                raise Uncompilable(self.disabled) from error
            if new:
                raise CompileError(
                    f"compiling the local steps failed: {one_line(error)}; run with --model.execution.init_args.compile false"
                ) from error
            raise


def _eager_error(unit_fn: Callable, args: tuple) -> BaseException | None:
    """The declared error (``Uncompilable``, ``ClientIdUnavailable``, a rule's ``ValueError``) ``unit_fn`` raises
    when run eagerly on ``args``, if any; the random state is restored (the eager fallback draws it again)."""
    with torch.random.fork_rng(devices=[]):
        try:
            unit_fn(*args)
        except Exception as error:
            return _declared_cause(error)
    return None


def _inductor_settings(backend: str) -> Any:
    """inductor's settings while the programs run: ``cpp.vec_isa_ok`` where ``_vec_isa_known`` (a no-op context otherwise)."""
    if backend != "inductor" or not _vec_isa_known():
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch({"cpp.vec_isa_ok": True})


def _vec_isa_known() -> bool:
    """Whether every vector instruction set this x86-64 CPU reports is known to build and load with this torch and
    C++ compiler: inductor otherwise probes them in every process, programs cached or not (~0.9 s: a test library
    built and loaded by 2 to 6 fresh Python processes). The probe's outcome is kept in inductor's cache folder
    (a fresh ``TORCHINDUCTOR_CACHE_DIR`` probes again); where an instruction set failed, or on another platform,
    or where ``TORCHINDUCTOR_VEC_ISA_OK`` is set, inductor's own handling is kept. Either way every process of a
    setting compiles with the same inductor settings (they are part of its cache key)."""
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if config.cpp.vec_isa_ok is not None or sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    flags = cpu_vec_isa.x86_isa_checker()
    reported = [str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]
    path = os.path.join(cache_dir(), "fl_lightning", f"vec_isa_ok-{_machine_key(reported)}")
    if os.path.exists(path):
        return True
    if [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] != reported:  # inductor's probe, once
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(" ".join(reported))
    return True


def _machine_key(reported: list[str]) -> str:
    """A digest of what the vector instruction set probe depends on: torch, Python, the C++ compiler, the CPU's sets."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = shutil.which(get_cpp_compiler()) or get_cpp_compiler()
    stamp = os.stat(compiler).st_mtime_ns if os.path.exists(compiler) else 0
    parts = [torch.__version__, os.path.realpath(sys.executable), compiler, stamp, reported]  # python and python3: one interpreter
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (its own counter: a guard that fails recompiles too)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _declared_cause(error: BaseException) -> BaseException | None:
    """A declared exception (``Uncompilable``, ``ClientIdUnavailable``, a ``ValueError`` of a rule) raised
    while tracing, which dynamo may have wrapped."""
    seen = error
    while seen is not None:
        if isinstance(seen, Uncompilable | ClientIdUnavailable | FLError | ValueError):
            return seen
        seen = seen.__cause__ or seen.__context__
        if seen is error:
            break
    return None


def tensor_lr(info: RoundInfo) -> RoundInfo:
    """``info`` with the step size as a 0-dim float64 tensor: a program input, not a constant of the
    graph, so a learning-rate schedule does not recompile every round."""
    return replace(info, local_lr=torch.scalar_tensor(info.local_lr, dtype=torch.float64),
                   personal_lr=None if info.personal_lr is None else torch.scalar_tensor(info.personal_lr, dtype=torch.float64))  # fmt: skip


def log_fallback(counter, reason: str, logger: logging.Logger = log, to: str = "eager") -> None:
    """Log a declared reason to run eagerly (or ``to`` another compiled unit) once, and count it."""
    if not counter[reason]:
        logger.warning("compiled execution falls back to %s: %s", to, reason)
    counter[reason] += 1
