"""Compiled client execution: a client's K local steps (or the stacked clients' K steps) as one program.

The program is the algorithm's rule as eager execution runs it (``client_init``, then K times
``ctx.grad`` and ``client_step``), with the gradient taken by ``Objective.grad_fn(...,
functional=True)`` so that ``torch.compile`` (inductor) traces the objective's forward, its loss
and their gradient together with the rule into one graph. Stacked clients run the same program
under ``vmap``. An algorithm's ``local_loss`` (MOON, FedNTD, FedLC, FedRS, FedDecorr) is traced with
the rest. ``client_finish`` stays eager (once a round, and it may read ``ctx.client_id``).

Compiled variants are keyed by what the graph depends on, and bounded:

- K (stragglers run fewer steps): one variant per distinct number of local steps;
- the batch shape: a client with fewer samples than ``local.batch_size`` trains on its whole
  set; such short batches share one variant with a dynamic batch dimension;
- S (batched): the number of stacked clients is padded up to a power of two, but at most to the
  fixed number of clients a round samples (``UniformSampling``), so a round without dropouts runs
  unpadded (the padding repeats the last client and is discarded; ``batched.padded_clients``):
  dropout uses at most log2(S) + 2 variants, Bernoulli participation log2(S) + 1.

A run that would need more than ``max_variants`` variants runs eagerly from then on (a
declared, logged reason). The variant chosen depends only on the round's shapes, never on
what was compiled before, so a resumed run uses the same programs as an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientContext, ClientIdUnavailable, RoundInfo
from fl_lightning.core.errors import FLError, one_line
from fl_lightning.core.local_loss import ClientLoss, defines_local_loss
from fl_lightning.core.objective import Objective
from fl_lightning.core.params import TensorDict

log = logging.getLogger(__name__)

DEFAULT_MAX_VARIANTS = 16


class Uncompilable(Exception):
    """A declared reason to run eagerly instead of compiled (the message says which)."""


class CompileError(FLError, RuntimeError):
    """Compilation failed for a reason other than a rule or model that cannot be traced."""


class _Recorder:
    """The ``record`` of ``grad_fn`` inside the program: every step's first evaluation, returned as outputs."""

    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items

    def add(self, loss: Tensor, out: Tensor | None, target: Tensor, terms: dict[str, Tensor] | None = None) -> None:
        self.items.append((loss, out, target, terms or {}))  # terms: an algorithm's local_loss terms ({}: none; vmap returns no None)


def _no_full_grad(params: TensorDict) -> TensorDict:
    raise Uncompilable("full local gradients read the client's whole training set, whose size differs by client")


def local_steps(
    algorithm: Algorithm, objective: Objective, weight_decay: float, params: TensorDict, client_state: Any, client: Any,
    info: RoundInfo, broadcast: Any, personal: TensorDict, batches: Sequence[Any], label_counts: Tensor | None = None,
) -> tuple[TensorDict, Any, list]:
    """One client's ``client_init`` and K local steps (K = ``len(batches)``): the traced program.

    An algorithm's ``local_loss`` (``fl_lightning.core.local_loss``) is traced with the rest, bound to the
    client as eager execution binds it (``label_counts``: the client's, where the algorithm reads them).
    Returns the parameters, the local state and each step's first evaluation (loss, outputs, targets,
    the local loss's terms: {} for the model's own loss).
    """
    ctx = ClientContext(client, broadcast, client_state, info, len(batches), full_grad=_no_full_grad, personal=personal)
    loss = ClientLoss(algorithm, client, broadcast, client_state, info, label_counts) if defines_local_loss(algorithm) else None
    local = algorithm.client_init(params, ctx)
    records: list = []
    for step, batch in enumerate(batches):
        ctx.step = step
        ctx.grad = objective.grad_fn(batch, weight_decay, _Recorder(records), functional=True, loss=loss)
        params, local = algorithm.client_step(params, local, ctx)
    return params, local, records


def stacked_local_steps(algorithm, objective, weight_decay, params, client_state, clients, info, broadcast, personal, batches,
                        label_counts=None):  # fmt: skip
    """``local_steps`` of stacked clients (a leading client dimension on params, state, ids, batches and label counts)."""

    def one(p, state, cid, b, counts):
        return local_steps(algorithm, objective, weight_decay, p, state, cid, info, broadcast, personal, b, counts)

    in_dims = (0, 0, 0, 0, None if label_counts is None else 0)
    return torch.func.vmap(one, in_dims=in_dims, randomness="different")(params, client_state, clients, batches, label_counts)


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


class CompiledPrograms:
    """The compiled local-step programs of one executor, their variants and compile time.

    Args:
        stacked: clients stacked on a leading dimension (batched execution) or one client at a time.
        max_variants: the most compiled variants; beyond it execution is eager (declared).
        backend: ``torch.compile``'s backend (``inductor``; ``aot_eager`` traces without generating code).
    """

    def __init__(self, stacked: bool, max_variants: int = DEFAULT_MAX_VARIANTS, backend: str = "inductor") -> None:
        self.stacked, self.max_variants, self.backend = stacked, max_variants, backend
        self.compile_seconds = 0.0
        self.compiled = 0  # graphs compiled (the variants actually built)
        self.variants: set[tuple] = set()  # the keys run so far
        self.disabled: str | None = None  # the declared reason execution went eager for good
        self._disabled_error: BaseException | None = None  # the declared error to raise again, if one was traced
        fn = stacked_local_steps if stacked else local_steps
        self._static = torch.compile(_fresh(fn), fullgraph=True, dynamic=False, backend=backend)
        self._dynamic = torch.compile(_fresh(fn), fullgraph=True, dynamic=True, backend=backend)
        # dynamo's settings while a program runs (and may compile), made once: building the patch costs
        # ~1 ms (a copy of dynamo's whole config), entering it ~15 us
        self._config = torch._dynamo.config.patch(
            recompile_limit=max_variants, fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False,
            automatic_dynamic_local_pgo=False,
        )  # fmt: skip

    def __call__(self, key: tuple, dynamic: bool, *args: Any) -> tuple[TensorDict, Any, list]:
        """Run the program for variant ``key`` (compiling it the first time); ``Uncompilable`` for a declared
        reason to run eagerly, ``CompileError`` (one line) for any other compile failure."""
        if self.disabled:
            raise self._disabled_error or Uncompilable(self.disabled)
        new = key not in self.variants
        if new and len(self.variants) >= self.max_variants:
            self.disabled = f"more than execution.max_variants = {self.max_variants} compiled variants would be needed"
            raise Uncompilable(self.disabled)
        started, graphs = time.perf_counter(), _graphs_compiled()
        try:
            with self._config:
                out = (self._dynamic if dynamic else self._static)(*args)
        except (Uncompilable, ClientIdUnavailable, FLError, ValueError):
            raise
        except Exception as error:
            cause = _declared_cause(error)
            if cause is not None:
                raise cause from error
            if _is_untraceable(error):
                declared = self._eager_error(args)  # a declared error raised while tracing: dynamo reports it only as observed
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
        self.variants.add(key)
        compiled = _graphs_compiled() - graphs
        if compiled:
            self.compiled += compiled
            self.compile_seconds += time.perf_counter() - started
        return out


    def _eager_error(self, args: tuple) -> BaseException | None:
        """The declared error (``Uncompilable``, ``ClientIdUnavailable``, a rule's ``ValueError``) the program
        raises when run eagerly, if any; the random state is restored (the eager fallback draws it again)."""
        with torch.random.fork_rng(devices=[]):
            try:
                (stacked_local_steps if self.stacked else local_steps)(*args)
            except Exception as error:
                return _declared_cause(error)
        return None


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


def log_fallback(counter, reason: str, logger: logging.Logger = log) -> None:
    """Log a declared reason to run eagerly once, and count it."""
    if not counter[reason]:
        logger.warning("compiled execution falls back to eager: %s", reason)
    counter[reason] += 1
