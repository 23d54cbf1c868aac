"""Batched execution: the round's clients train together, stacked on a leading dimension.

Parameters, local optimizer state and client state are stacked on a leading client
dimension and each step takes one ``[S, B, ...]`` batch (``ClientData.stacked_client_batches``:
the samples of sequential execution). The per-client losses come from one ``vmap`` of the
objective; one backward of their sum gives every client's own gradient.

A rule whose own class declares ``elementwise = True`` is applied once to the stacked
tensors; any other rule runs per client under ``vmap``. ``client_finish`` runs stacked
for an elementwise rule that does not read ``ctx.client_id``; otherwise client by client
on the final tensors.

Sequential execution is used instead only for declared reasons (logged once each);
any other error is re-raised. The round's clients then train sequentially: a client
that fails there too is handled as sequential execution handles it (left out for a
declared or transient failure, the run stopped with ``FatalClientError`` for any other
error); if none fails, the batched path is wrong and ``BatchedExecutionError`` stops the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, ClientIdUnavailable, RoundInfo, declares_capability
from fl_lightning.core.client_data import Unstackable, batch_targets
from fl_lightning.core.client_rows import model_declares
from fl_lightning.executors.dpsgd import client_noise, dp_sampler, private_grad_fn, private_steps
from fl_lightning.core.errors import FLError, interrupted, one_line
from fl_lightning.executors import masking as M
from fl_lightning.executors.base import ClientRuntime, Executor, check_loss, data_pass_fn, finish_client, seed_client, to_device
from fl_lightning.executors.round_program import CompiledRound, RoundProgram
from fl_lightning.executors.compiled import DEFAULT_MAX_VARIANTS, CompiledPrograms, Uncompilable, log_fallback, tensor_lr
from fl_lightning.executors.sequential import SequentialExecutor, compiled_unsupported_reason
from fl_lightning.core.local_loss import client_loss, defines_local_loss
from fl_lightning.core.objective import StepRecord
from fl_lightning.core.participation import UniformSampling
from fl_lightning.core.params import TensorDict
from fl_lightning.core.round_results import RoundResults, merged, same_tensors, unstacked
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import ClientResult, ClientTask, Payload, RoundTasks, shared_states, shares_broadcast, subset, task_columns

log = logging.getLogger(__name__)


class Unbatchable(Exception):
    """A declared reason to run a round's clients one after another (the message says which)."""


class StepsUnequal(Unbatchable):
    """The rule reads ``ctx.num_steps`` in its local steps, and the stacked clients run different numbers of steps."""


FULL_BATCH_ROWS = 1 << 16
"""The most rows (clients x the largest client's samples) of a stack's whole sets for ``ctx.full_grad``."""


class FullGradients(Unbatchable):
    """The rule reads ``ctx.full_grad`` (the gradient on the client's whole training set), which the stack was not given."""


class BatchedExecutionError(FLError, RuntimeError):
    """The batched path raised where the same clients train sequentially without error."""


@dataclass(frozen=True)
class _RoundSteps:
    """A stacked group's local steps: each client's K_i, the step mask of a padded round (bool ``[S, K]``,
    None where every client runs every step) and whether real batches hold padded rows."""

    steps: list[int]
    mask: Tensor | None
    padded_rows: bool
    padded: bool = False  # the batches were padded (``_padded``): a round of unequal work

    @property
    def equal(self) -> bool:
        return len(set(self.steps)) == 1


def _row_bucket(batch_size: int | None, rows: int) -> int:
    """Compiled execution's rows bucket: the next power of two, but never beyond ``local.batch_size`` (a full batch)."""
    power = M.power_of_two(rows)
    return power if batch_size is None or rows > batch_size else min(power, batch_size)


class _FinishContext(ClientContext):
    """The stacked finish's context for one K: records whether the rule read ``ctx.num_steps`` or ``ctx.step``."""

    read = False

    @property
    def num_steps(self) -> int:
        self.read = True
        return self._num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self._num_steps = value

    @property
    def step(self) -> int:
        self.read = True
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value


def _sizes(tasks: Sequence[ClientTask], runtime: ClientRuntime) -> Tensor:
    """The tasks' clients' training sizes (int64 ``[S]``), in one gather."""
    return runtime.data.client_sizes[torch.tensor(task_columns(tasks).client_ids, dtype=torch.int64)]


def _stacked_clients(batch: Any) -> int:
    """The clients S of a stacked ``[S, B, ...]`` batch."""
    return batch_targets(batch).shape[0]


def _stacked_rows(batch: Any) -> int:
    """The rows B of a stacked ``[S, B, ...]`` batch (its target's second dimension)."""
    return batch_targets(batch).shape[1]


def _tensor_leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _tensor_leaves(v)]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in _tensor_leaves(v)]
    return [tree]


class _UnequalStepsContext(ClientContext):
    """The context of stacked clients that run different numbers of steps: ``ctx.num_steps`` is not one
    number, so a rule reading it in its local steps runs in stacks of clients of equal K (``StepsUnequal``)."""

    @property
    def num_steps(self) -> int:
        raise StepsUnequal("the rule reads ctx.num_steps in its local steps, and the round's clients run different numbers of steps")

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        pass


def _stack(states: list[Any]) -> Any:
    """Stack a list of equally-shaped nested tensor dicts along a new leading dimension."""
    first = states[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in states]) for k in first}
    return torch.stack(states)


def _load_states(tasks: Sequence[ClientTask]) -> tuple[list[Any] | None, Any, Any]:
    """The clients' states (one per client where they were loaded client by client, else None; and stacked) and
    personal tensors (stacked): one ``gather`` from the round's state table where the tasks share one, else client
    by client."""
    table = shared_states(tasks)
    if table is not None:
        loaded = table.gather(torch.tensor(task_columns(tasks).client_ids, dtype=torch.int64))
        if loaded is not None:
            return None, loaded.algorithm, loaded.personal
    loaded = [task.load_state() for task in tasks]
    states = [state.algorithm for state in loaded]
    return states, _stack(states), _stack([state.personal for state in loaded])


def _pad_clients(extra: int, tree: Any) -> Any:
    """``tree``'s tensors with ``extra`` copies of their last client appended (compiled execution's padding)."""
    if not extra or tree is None:
        return tree
    if isinstance(tree, dict):
        return {k: _pad_clients(extra, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_pad_clients(extra, v) for v in tree)
    return torch.cat([tree, tree[-1:].expand(extra, *tree.shape[1:])])


def padded_clients(size: int, cohort: int | None) -> int:
    """The number of stacked clients a compiled program runs for ``size`` clients: the next power of two,
    but at most ``cohort`` (the fixed number of clients a round samples, when there is one). A round
    without dropouts then runs unpadded in one program, and rounds with dropouts or varying
    participation use at most log2(cohort) + 2 programs (log2(S) + 1 without a fixed cohort)."""
    power = 1 << (size - 1).bit_length()
    return min(power, cohort) if cohort is not None and size <= cohort else power


def _unpad_clients(extra: int, tree: Any) -> Any:
    """``tree``'s tensors without their last ``extra`` clients (``_pad_clients``' padding cut off); ``tree`` itself
    when nothing was padded."""
    if not extra or tree is None:
        return tree
    if isinstance(tree, dict):
        return {k: _unpad_clients(extra, v) for k, v in tree.items()}
    return tree[:-extra]


def _check_losses_ignore_padded_rows(algorithm: Any, objective: Any) -> None:
    """``Unbatchable`` unless every loss the clients' batches go through leaves padded rows (target -100) out: the
    rule's own ``local_loss`` and the model's own loss must declare it."""
    if defines_local_loss(algorithm) and not declares_capability(algorithm, "local_loss_ignores_padded_rows"):
        raise Unbatchable(
            f"{type(algorithm).__name__}'s local_loss reduces over the batch's rows, which padded rows (clients with "
            "batches of unequal size) would enter (a local_loss that leaves them out declares local_loss_ignores_padded_rows = True)"
        )
    if objective.custom_loss is not None and not model_declares(objective.model, "loss_ignores_padded_rows"):
        raise Unbatchable(
            "the model's own loss reduces over the batch's rows, which padded rows (clients with batches of unequal size) "
            "would enter (a model whose loss ignores targets -100 declares loss_ignores_padded_rows = True)"
        )


def _no_full_grad(params: TensorDict) -> TensorDict:
    raise FullGradients("the rule reads full local gradients (ctx.full_grad), each client's whole set: stacked under vmap "
                        "(a rule run per client), client by client for an elementwise rule's stacked steps")


def _no_data_pass(params: TensorDict) -> Any:
    raise Unbatchable(
        "a pass over each client's whole training set (ctx.data_pass) in local steps or in an elementwise rule's stacked "
        "client_finish runs client by client (clients differ in size)"
    )


def _model_not_vmappable(error: Exception, runtime: ClientRuntime) -> str | None:
    """The declared reason when a rule that runs per client under vmap meets a model whose forward
    vmap cannot trace (e.g. transformers' masking code, which branches on tensor values); else None."""
    if not (isinstance(error, RuntimeError) and str(error).startswith("vmap:")):
        return None
    if defines_local_loss(runtime.algorithm):
        return f"{type(runtime.algorithm).__name__}'s local_loss runs per client under vmap, and the model's forward cannot run under vmap"
    if declares_capability(runtime.algorithm, "elementwise"):
        return None
    return (
        f"{type(runtime.algorithm).__name__} does not declare elementwise = True, so its rule runs per client under vmap, "
        "and the model's forward cannot run under vmap (it branches on tensor values)"
    )


def _user_declared_elementwise(algorithm: Any) -> bool:
    """Whether ``elementwise`` holds for ``algorithm`` by a declaration outside fl-lightning's own classes."""
    if not declares_capability(algorithm, "elementwise"):
        return False
    declarer = next((c for c in type(algorithm).__mro__ if "elementwise" in vars(c)), type(algorithm))
    return "elementwise" in vars(algorithm) or not declarer.__module__.startswith("fl_lightning.")


def _verify_against_sequential(
    batched: list[ClientResult], sequential: list[ClientResult], runtime: ClientRuntime, info: RoundInfo
) -> None:
    """``verify_first_round``: the batched round's uploads and client states against sequential execution's."""
    name = type(runtime.algorithm).__name__
    by_id = {r.client_id: r for r in sequential}
    for result in batched:
        other = by_id.get(result.client_id)
        if other is None:
            continue  # it failed sequentially: a client fault, not the check's concern
        pairs = (("upload", result.upload, other.upload), ("client state", result.client_state, other.client_state))
        for part, ours, theirs in pairs:
            for key, a, b in _leaves(ours, theirs):
                if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-6):
                    gap = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("inf")
                    raise BatchedExecutionError(
                        f"round {info.round}: {name} declares elementwise = True, but its batched {part} {key} of client "
                        f"{result.client_id} differs from sequential execution's by {gap:.3g} (verify_first_round); a norm, sum or "
                        "other reduction in a rule applied to all clients' stacked tensors mixes the clients: remove the "
                        "declaration (the rule then runs per client under vmap) or make the rule elementwise"
                    )


def _leaves(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Tensor, Tensor]]:
    """Matching tensors of two nested dicts (a key missing on one side compares as a mismatch)."""
    if isinstance(a, dict):
        b = b if isinstance(b, dict) else {}
        keys = list(a) + [k for k in b if k not in a]
        missing = torch.full((1,), float("nan"))
        return [leaf for k in keys for leaf in _leaves(a.get(k, missing), b.get(k, missing), f"{prefix}{k}/")]
    return [(prefix.rstrip("/"), a, b)]


class BatchedExecutor(Executor):
    """Run all tasks' local steps together; sequential execution only for declared reasons.

    Args:
        max_stacked_clients: stack at most this many clients at once; a round of more runs as
            consecutive groups of this size (the last one smaller). Bounds the memory of the
            stacked activations (they grow with every stacked client's batch) and, where one
            batch of every client's rows no longer fits the caches, can be faster. ``None``: the
            whole round at once. Results are the same to float tolerance for every value.
        verify_first_round: where the algorithm's ``elementwise = True`` is declared by a class
            outside fl-lightning (a user's), run its first batched round sequentially too and stop
            with ``BatchedExecutionError`` if the uploads or client states differ (a reduction in a
            rule declared elementwise mixes the stacked clients). Costs one sequential round per run.
        compile: run the stacked clients' K local steps as one compiled program (``torch.compile``
            of ``vmap`` of the rule; ``fl_lightning.executors.compiled``, docs/performance.md);
            rounds that run sequentially run sequential compiled execution. Results equal eager
            execution's to float tolerance; what cannot be compiled runs eagerly (declared, logged).
        max_variants: with ``compile``, the most compiled programs (shapes) before running eagerly.
        backend: with ``compile``, ``torch.compile``'s backend (``inductor``, or ``aot_eager``: see ``SequentialExecutor``).
        compile_unit: with ``compile``, the stacked clients' program: ``"auto"`` (the default: ``"round"`` for
            rounds of equal work, ``"step"`` for masked stacking's rounds of unequal work, run as one stack in
            decreasing K whose rows are padded to ``local.batch_size`` and which shrinks as clients finish, so one
            ladder of programs (a power of two of clients each) serves every K and straggler), ``"round"``
            (the K steps unrolled: faster than one step a program at S = 50, docs/performance.md; masked rounds
            then pad K and B to powers of two, one program each) or ``"step"`` (one step, called K times); see
            ``SequentialExecutor``. Rounds run sequentially use the same unit (``"auto"``: ``"round"``).
        max_padding_waste: masked stacking (clients with unequal local work padded to the round's largest K and B,
            docs/performance.md): where one stack would waste more than this share of its work on padding, in [0, 1),
            its clients are stacked in groups of similar work. An elementwise rule's eager stack and compiled
            execution's step program instead run one stack in decreasing K that shrinks as clients finish.
        max_buckets: the most such groups a round is split into (1: one stack, whatever the waste).
        masked_stacking: stack clients with unequal local work by padding and masking (true, the default); false
            runs such rounds sequentially, as before masked stacking (a declared reason).
        compile_round: with ``compile``, run each round that allows it as one compiled program: the clients' local
            steps, the aggregate and the server optimizer's step together (``fl_lightning.executors.round_program``,
            docs/performance.md "The compiled round"); other rounds run as without it, the reason logged once.
        steps_per_call: with ``compile``, the step program's steps per call in masked rounds: 1 (the default) or 2
            (two consecutive steps of the same stack as one program, the pair program: half the calls, each paying
            dynamo's and AOT's entry, for about twice the compile time; docs/performance.md, "Two steps a call").
            Rounds run sequentially use the same setting (``SequentialExecutor``, which checks it with the other
            compile settings).
    """

    def __init__(
        self, max_stacked_clients: int | None = None, verify_first_round: bool = False, compile: bool = False,
        max_variants: int = DEFAULT_MAX_VARIANTS, backend: str = "inductor", compile_unit: str = "auto",
        max_padding_waste: float = 0.5, max_buckets: int = 4, masked_stacking: bool = True, steps_per_call: int = 1,
        compile_round: bool = False,
    ) -> None:
        if max_stacked_clients is not None and (type(max_stacked_clients) is not int or max_stacked_clients < 1):
            raise ValueError(f"execution.max_stacked_clients must be an integer >= 1 or null, got {max_stacked_clients!r}")
        if isinstance(max_padding_waste, bool) or not isinstance(max_padding_waste, int | float) or not 0.0 <= max_padding_waste < 1.0:
            raise ValueError(f"execution.max_padding_waste must be a number in [0, 1), got {max_padding_waste!r}")
        if type(max_buckets) is not int or max_buckets < 1:
            raise ValueError(f"execution.max_buckets must be an integer >= 1, got {max_buckets!r}")
        if type(masked_stacking) is not bool:
            raise ValueError(f"execution.masked_stacking must be true or false, got {masked_stacking!r}")
        if type(compile_round) is not bool or (compile_round and not compile):
            raise ValueError(f"execution.compile_round must be true or false, and true only with execution.compile true, got {compile_round!r}")
        self.max_padding_waste, self.max_buckets, self.masked_stacking = float(max_padding_waste), max_buckets, masked_stacking
        self._work = [0, 0]
        #: rounds run, rounds run stacked, and the stacked work (rows x steps x clients) that was real and that was padding
        self.stats: dict[str, int] = {"rounds": 0, "stacked_rounds": 0, "real_work": 0, "padded_work": 0}
        self.max_stacked_clients = max_stacked_clients
        self.verify_first_round = verify_first_round
        self._verified: set[type] = set()
        self.sequential = SequentialExecutor(compile=compile, max_variants=max_variants, backend=backend, compile_unit=compile_unit, steps_per_call=steps_per_call)
        self.compile = compile
        self.programs = CompiledPrograms(stacked=True, max_variants=max_variants, backend=backend, unit=compile_unit, steps_per_call=steps_per_call) if compile else None
        self.compile_unit = compile_unit
        self.round_program = RoundProgram(backend, max_variants) if compile_round else None
        if compile_round:
            self.stats["compiled_rounds"] = 0  # rounds run as one program (``run_round``)
        self.compile_fallbacks: Counter[str] = Counter()  # compiled execution: stacked rounds run eagerly, by reason
        self.fallbacks: Counter[str] = Counter()  # rounds run sequentially, by reason
        self._finish_per_client: set[type] = set()  # rules whose client_finish reads ctx.client_id
        self._equal_steps: set[type] = set()  # rules whose local steps read ctx.num_steps: stacks of clients of equal K
        self._full_gradients: set[type] = set()  # rules reading ctx.full_grad: the stack gets its clients' whole sets
        self._smallest: tuple[Tensor, int] | None = None  # (client_sizes, its minimum): ``_smallest_client``

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> Sequence[ClientResult]:
        if not tasks:
            return []
        if tasks.warmup if isinstance(tasks, RoundTasks) else any(task.warmup for task in tasks):  # a pass over every client, once: not worth stacking
            return self.sequential.run(tasks, info, runtime)
        self.stats["rounds"] += 1
        reason = self.unsupported_reason(tasks, runtime)
        if reason is None:
            self._work = [0, 0]  # the round's real and padded work, counted once it has run stacked
            try:
                try:
                    results = self._run_groups(tasks, info, runtime)
                except (StepsUnequal, FullGradients) as error:  # a need found by running: run the round again to meet it
                    needs = self._equal_steps if isinstance(error, StepsUnequal) else self._full_gradients
                    if type(runtime.algorithm) in needs:
                        raise
                    needs.add(type(runtime.algorithm))  # from now on: stacks of clients of equal K; the clients' whole sets given
                    log.info("batched execution runs %s's rounds again: %s", type(runtime.algorithm).__name__, error)
                    self._work = [0, 0]
                    results = self._run_groups(tasks, info, runtime)
                self.stats["stacked_rounds"] += 1
                self.stats["real_work"] += self._work[0]
                self.stats["padded_work"] += self._work[1]
                algorithm = runtime.algorithm
                if self.verify_first_round and type(algorithm) not in self._verified and _user_declared_elementwise(algorithm):
                    self._verified.add(type(algorithm))
                    _verify_against_sequential(results, self.sequential.run(tasks, info, runtime), runtime, info)
                return results
            except FLError:  # divergence, SIGTERM: known errors, not bugs of the batched path
                raise
            except (Unbatchable, Unstackable, M.Unmaskable) as error:
                reason = str(error)
            except ClientIdUnavailable:
                reason = f"{type(runtime.algorithm).__name__} reads ctx.client_id in its local steps (ctx.client holds the ids)"
            except Exception as error:
                reason = _model_not_vmappable(error, runtime)
                if reason is None:
                    results = self.sequential.run(tasks, info, runtime)
                    if len(results) == len(tasks):
                        raise BatchedExecutionError(
                            f"round {info.round}: batched execution raised {one_line(error)} where sequential execution did not; "
                            "run with --model.execution sequential and report it"
                        ) from error
                    return results  # a client fails in sequential execution too: a client fault
        if not self.fallbacks[reason]:
            log.warning("batched execution falls back to sequential: %s", reason)
        self.fallbacks[reason] += 1
        return self.sequential.run(tasks, info, runtime)

    @property
    def runs_rounds(self) -> bool:
        return self.round_program is not None

    def run_round(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime, server: Any) -> CompiledRound | None:
        program = self.round_program
        if program is None or not tasks or tasks.warmup:
            return None
        reason = program.unsupported(tasks, runtime, server, self._idealised(tasks, runtime)) or self.unsupported_reason(tasks, runtime)
        compiled = program.run(tasks, info, runtime, server, _load_states, self._means) if reason is None else None
        if compiled is None:
            program.fallback(reason or program.disabled)
            return None
        self.stats["rounds"] += 1
        self.stats["stacked_rounds"] += 1
        self.stats["compiled_rounds"] += 1
        self.stats["real_work"] += len(tasks) * runtime.local.steps * runtime.local.batch_size
        return compiled

    @staticmethod
    def unsupported_reason(tasks: Sequence[ClientTask], runtime: ClientRuntime) -> str | None:
        """Why these tasks cannot run stacked (known before running), or None."""
        algorithm = runtime.algorithm
        model = runtime.objective.model
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats for m in model.modules()):
            return "BatchNorm running statistics are module state that vmap cannot update per client"
        if not getattr(algorithm, "batchable", True):
            return f"{type(algorithm).__name__} declares batchable = False"
        return None

    # ---- the round ---------------------------------------------------------------------------
    def _run_groups(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> RoundResults:
        """The tasks stacked in groups: clients of similar work together where one stack would waste more
        than ``max_padding_waste`` on padding (``masking.buckets``), each in consecutive groups of at most
        ``max_stacked_clients``; the results in task order."""
        size = self.max_stacked_clients or len(tasks)
        parts = []
        for bucket in self._buckets(tasks, runtime):
            for start in range(0, len(bucket), size):
                group = bucket[start : start + size]
                parts.append((group, self._run_stacked(subset(tasks, group), info, runtime)))
        return merged(parts, len(tasks))

    @property
    def _one_masked_program(self) -> bool:
        """Compiled masked rounds run the step program as one stack (``compile_unit: auto``): no groups, rows padded
        to ``local.batch_size``, K as it is (the program does not depend on it)."""
        return self.programs is not None and self.compile_unit == "auto" and not self.programs.step_unavailable

    def _buckets(self, tasks: Sequence[ClientTask], runtime: ClientRuntime) -> list[list[int]]:
        if self._idealised(tasks, runtime) or not self.masked_stacking:
            return [list(range(len(tasks)))]
        if type(runtime.algorithm) in self._equal_steps:  # one stack per K, the largest first
            steps = task_columns(tasks).num_steps
            return [[i for i, own in enumerate(steps) if own == k] for k in sorted(set(steps), reverse=True)]
        shrinks = self._one_masked_program or (
            self.programs is None and declares_capability(runtime.algorithm, "elementwise") and shares_broadcast(tasks)
        )  # per-client broadcasts (heterogeneous LoRA ranks) keep every client in the stack: buckets then waste less
        if shrinks:  # one stack in decreasing K: it shrinks as clients finish (masking.stack_sizes)
            steps = task_columns(tasks).num_steps
            return [sorted(range(len(tasks)), key=lambda i: -steps[i])]
        if self.max_buckets == 1:
            return [list(range(len(tasks)))]
        return M.buckets(self._works(tasks, runtime), self.max_padding_waste, self.max_buckets, self._bucket)

    @staticmethod
    def _works(tasks: Sequence[ClientTask], runtime: ClientRuntime) -> list[M.Work]:
        local, sizes = runtime.local, _sizes(tasks, runtime).tolist()
        return [M.client_work(n, local.batch_size, local.steps, local.epochs, k) for n, k in zip(sizes, task_columns(tasks).num_steps)]

    @property
    def _bucket(self):
        """Compiled execution pads K and B up to powers of two (a bounded number of programs); eager execution pads to the largest."""
        return M.power_of_two if self.programs is not None else None

    def _idealised(self, tasks: Sequence[ClientTask], runtime: ClientRuntime) -> bool:
        """Whether every client runs ``local.steps`` steps of ``local.batch_size`` rows (stacked without padding)."""
        local = runtime.local
        if local.steps is None or local.batch_size is None or any(k != local.steps for k in task_columns(tasks).num_steps):
            return False
        sizes = runtime.data.client_sizes
        if self._smallest_client(sizes) >= local.batch_size:  # every client holds a full batch: nothing to look up
            return True
        ids = torch.as_tensor(task_columns(tasks).client_ids, dtype=torch.int64)
        return not bool((sizes[ids] < local.batch_size).any())

    def _smallest_client(self, sizes: Tensor) -> int:
        """The smallest of the clients' training sizes, computed once per ``client_sizes`` tensor (a datamodule
        sets it at setup), not in each of the round's three stacking decisions."""
        if self._smallest is None or self._smallest[0] is not sizes:
            self._smallest = (sizes, int(sizes.min()) if len(sizes) else 0)
        return self._smallest[1]

    def _padded(self, tasks: Sequence[ClientTask], runtime: ClientRuntime) -> Any:
        """The round's batches padded to its largest K and B (``ClientData.padded_client_batches``), checked to be maskable."""
        local, algorithm, objective = runtime.local, runtime.algorithm, runtime.objective
        padded_batches = getattr(runtime.data, "padded_client_batches", None)
        if padded_batches is None:
            raise Unbatchable(f"the data ({type(runtime.data).__name__}) has no padded_client_batches for clients with unequal local work")
        columns = task_columns(tasks)
        steps, rows = max(columns.num_steps), M.largest_rows(_sizes(tasks, runtime), local.batch_size)  # the largest Work's
        if self._one_masked_program:  # one step program for every K: only the rows are bucketed
            rows = _row_bucket(local.batch_size, rows if local.batch_size is None else max(rows, local.batch_size))
        elif self.programs is not None:  # buckets: a bounded number of compiled programs
            steps, rows = M.power_of_two(steps) if type(algorithm) not in self._equal_steps else steps, _row_bucket(local.batch_size, rows)
        padded = padded_batches(
            columns.client_ids, columns.seeds, local.batch_size, local.steps, local.epochs,
            columns.num_steps, min_steps=steps, min_rows=rows,
        )  # fmt: skip
        real = padded.real_rows
        if bool(((real > 0) & (real < padded.rows)).any()):  # some real batch holds padded rows
            _check_losses_ignore_padded_rows(algorithm, objective)
        return padded

    def _run_stacked(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> RoundResults:
        local, per_client = runtime.local, not shares_broadcast(tasks)
        broadcast = tasks.broadcast if isinstance(tasks, RoundTasks) and not per_client else tasks[0].broadcast
        if per_client:  # clients of different LoRA ranks receive their own x (fl_lightning/lora/server.py)
            if not declares_capability(runtime.algorithm, "elementwise"):
                raise Unbatchable(f"the clients receive different x and {type(runtime.algorithm).__name__}'s rule is not elementwise")
            broadcast = {k: _stack([t.broadcast[k] for t in tasks]) if isinstance(v, dict) else v for k, v in broadcast.items()}
        clients, seeds, steps = task_columns(tasks)
        dp = runtime.record_privacy
        masks, rows_padded = None, False  # (step mask [S, K], real rows [S, K] or None) of a padded round; whether real batches hold padded rows
        padded = None  # a round of unequal work's padded batches
        if dp is not None:  # record-level DP-SGD: each client's own draws, padded to the step's largest (fl_lightning.executors.dpsgd)
            if not declares_capability(runtime.algorithm, "elementwise"):
                raise Unbatchable(f"record-level DP-SGD runs {type(runtime.algorithm).__name__}'s rule (not elementwise) client by client")
            # Each client's own draws and noise, K_max steps of them: a client's draws past its K_i come after every draw
            # of its own steps (sequential execution's), and its padded steps are masked
            samplers, depth = [dp_sampler(dp, c, s) for c, s in zip(clients, seeds)], max(steps)
            batches = private_steps(runtime.data, clients, samplers, depth, stacked=True)
            if any(k != depth for k in steps):
                masks = (torch.arange(depth).view(1, -1) < torch.tensor(steps).view(-1, 1), None)
            self._count(sum(steps), len(tasks) * depth - sum(steps))
        elif self._idealised(tasks, runtime):
            batches = runtime.data.stacked_client_batches(clients, seeds, local.batch_size, local.steps)
            self._count(len(tasks) * local.steps * local.batch_size, 0)
        elif not self.masked_stacking:
            raise Unbatchable("the round's clients run unequal local work (steps or batch sizes), and execution.masked_stacking is false")
        else:
            padded = self._padded(tasks, runtime)
            batches, masks = padded.batches, (padded.step_mask, padded.real_rows)
            rows_padded = bool(((padded.real_rows > 0) & (padded.real_rows < padded.rows)).any())
            real = int(padded.real_rows.sum())
            self._count(real, len(tasks) * padded.steps * padded.rows - real)
        states, stacked_states, personal = _load_states(tasks)
        personal = personal if runtime.personal_names else {}  # each client's own, stacked
        # Different randomness per client (dropout); the CPU generator seeded from the group's first client.
        seed_client(seeds[0], runtime.device)
        params = dict(broadcast["x"]) if per_client else {k: v.unsqueeze(0).expand(len(tasks), *v.shape) for k, v in broadcast["x"].items()}
        params.update(personal)
        ids = torch.tensor(clients)
        record = StepRecord()
        self._seeds = seeds  # the clients' round seeds (record-level DP-SGD's noise)
        self._per_client_x = per_client  # the broadcast's entries are stacked: each client's own (per-client finish takes its row)
        step_mask = None if masks is None or bool(masks[0].all()) else masks[0].to(runtime.device)
        self._round = _RoundSteps(steps, step_mask, rows_padded, padded=padded is not None)
        rule = self._elementwise_rule if declares_capability(runtime.algorithm, "elementwise") else self._vmapped_rule
        if self.programs is not None and per_client:  # the compiled programs capture one broadcast for all clients
            log_fallback(self.compile_fallbacks, "the clients receive different x (heterogeneous LoRA ranks)", log)
        elif self.programs is not None:
            rule = functools.partial(self._compiled_rule, rule)
        device = runtime.device
        move = (lambda b: b.to(device)) if dp is not None else (lambda b: to_device(b, device))
        step_batches = M.StepBatches(batches, move, None if padded is None else padded.leading)  # leading: a shrinking stack's cut draws
        loss = client_loss(runtime.algorithm, ids, broadcast, stacked_states, info, runtime.data, runtime.device)
        norms = runtime.objective.batch_norms
        over_real_rows = rows_padded or type(runtime.algorithm) in self._full_gradients  # (the whole sets may be padded)
        with norms.install() if over_real_rows and norms.layers else contextlib.nullcontext():  # (29.4): BatchNorm over real rows
            params, local_state = rule(runtime, params, stacked_states, ids, broadcast, info, step_batches, record, loss, personal)
        uploads, new_states = self._finish(runtime, params, local_state, (states, stacked_states), ids, broadcast, info, personal)
        mean_losses, accuracies, terms = self._means(record, masks, len(tasks))
        for client, loss in zip(clients, mean_losses if record.losses else []):
            check_loss(info.round, client, loss)
        if not isinstance(uploads, dict):  # finished client by client: stacked where aggregation would stack them anyway
            stacked = _stacked_small(uploads), _stacked_small(new_states)
            if None not in stacked:
                uploads, new_states = stacked
        if isinstance(uploads, dict):  # the results stay stacked
            return RoundResults.stacked(clients, steps, mean_losses, accuracies, uploads, new_states, terms)
        rows = [{k: v[i] for k, v in terms.items()} for i in range(len(clients))]
        return RoundResults.of(
            [ClientResult(c, uploads[i], new_states[i], steps[i], mean_losses[i], accuracies[i], rows[i]) for i, c in enumerate(clients)]
        )

    def _count(self, real: int, padding: int) -> None:
        self._work[0] += real
        self._work[1] += padding

    @staticmethod
    def _means(record: StepRecord, masks: tuple[Tensor, Tensor | None] | None, size: int) -> tuple[list[float], list[float], dict[str, list[float]]]:
        """Each client's mean loss, accuracy and loss terms (each term's per-client means) over its real steps and rows.

        The loss and accuracy are ``[S]`` tensors read back together: one host transfer (``.tolist()`` of
        their stack, exact in float64) for the round, not one per metric or client."""
        nan = [float("nan")] * size
        columns: dict[str, Tensor] = {}
        if masks is None:
            if record.losses:
                columns["loss"] = torch.stack(record.losses).mean(0)
            correct = record.correct()
            if correct is not None:
                columns["acc"] = correct / record.samples()
            terms = record.term_means() or {}
        else:
            step_mask, real = masks
            if record.losses and len(record.losses) != step_mask.shape[1]:
                raise Unbatchable("the rule records a loss at only some of its steps, which a padded round cannot mask")
            if record.losses:
                columns["loss"] = M.masked_round_means(record.losses, step_mask)
            if record.outputs:  # real rows are given wherever outputs are recorded (not record-level DP-SGD's steps)
                columns["acc"] = M.masked_correct(record.outputs, record.targets, step_mask).cpu() / real.sum(1)
            terms = M.masked_term_means(record.terms, step_mask)
        if not columns:
            return nan, nan, terms
        values = torch.stack([c.detach().to("cpu", torch.float64) for c in columns.values()]).tolist()
        read = dict(zip(columns, values))
        return read.get("loss", nan), read.get("acc", nan), terms

    def _context(
        self, ids: Tensor, broadcast: Payload, state: Any, info: RoundInfo, runtime: ClientRuntime, num_steps: int | None = None,
        full_grad=_no_full_grad, **kw,
    ) -> ClientContext:
        """The stacked clients' context (``num_steps``: one client's K, where the context is that client's)."""
        steps = self._round.steps
        if num_steps is None and not self._round.equal:
            return _UnequalStepsContext(ids, broadcast, state, info, 0, full_grad=full_grad, data_pass=_no_data_pass, **kw)
        num_steps = steps[0] if num_steps is None else num_steps
        return ClientContext(ids, broadcast, state, info, num_steps, full_grad=full_grad, data_pass=_no_data_pass, **kw)

    def _elementwise_rule(self, runtime, params, client_state, ids, broadcast, info, batches, record, loss=None, personal=None):
        """The rule applied once to all clients' stacked tensors (no vmap around it)."""
        algorithm, objective, weight_decay = runtime.algorithm, runtime.objective, runtime.local.weight_decay
        ctx = self._context(ids, broadcast, client_state, info, runtime, personal=personal or {})
        local_state = algorithm.client_init(params, ctx)
        dp = runtime.record_privacy
        if dp is not None:  # the clients' noise sources and B_i, as sequential execution's
            noise, denominators = client_noise(dp, ids.tolist(), self._seeds)
        mask, padded_rows = self._round.mask, self._round.padded_rows
        sizes = self._shrinking_sizes(len(ids), local_state, dp)
        stack = None if sizes is None else M.ShrinkingStack(sizes, len(ids))
        if stack is not None and isinstance(batches, M.StepBatches):
            batches = batches.cut(sizes)  # the finished clients' rows are not gathered
        for step, batch in enumerate(batches):
            if runtime.should_stop():
                raise interrupted(info.round, int(ids[0]), step, max(self._round.steps))
            if stack is not None:
                if step == 0:  # the rows of the clients set aside are not computed
                    self._count(0, -_stacked_rows(batch) * M.set_aside(sizes, len(self._round.steps)))
                cut = stack.shrink(step, (params, local_state), (ids, client_state, personal, mask, None if loss is None else loss.label_counts))
                if cut is not None:  # the last clients are done: set aside, the rest run on
                    (params, local_state), (ids, client_state, personal, mask, counts) = cut
                    if loss is not None:
                        loss = dataclasses.replace(loss, client=ids, client_state=client_state, label_counts=counts)
                    ctx = self._context(ids, broadcast, client_state, info, runtime, personal=personal or {})
                batch = stack.rows(batch)
            ctx.step = step
            if dp is not None:
                ctx.grad = private_grad_fn(
                    objective, batch, noise, denominators, dp.clip_norm, weight_decay, record, loss, stacked=True, name=type(algorithm).__name__
                )
            else:
                ctx.grad = objective.grad_fn(batch, weight_decay, record, stacked=True, loss=loss, padded_rows=padded_rows)
            new_params, new_state = algorithm.client_step(params, local_state, ctx)
            if mask is None:
                params, local_state = new_params, new_state
            else:  # a client's padded step changes nothing
                params, local_state = M.keep_where(mask[:, step], (new_params, new_state), (params, local_state))
        if stack is not None:
            params, local_state = stack.joined((params, local_state))
        return params, local_state

    def _shrinking_sizes(self, size: int, local_state: Any, dp: Any) -> list[int] | None:
        """The stack's size at each step of an eager masked round whose clients run in decreasing K (``_buckets``):
        exactly the clients still running (``masking.stack_sizes``); None where the stack keeps every client (no step
        is padded, record-level DP-SGD, per-client broadcasts, or local state shared by the clients)."""
        if self._round.mask is None or dp is not None or self._per_client_x or not M.all_stacked(local_state, size):
            return None
        return M.stack_sizes(self._round.steps, size, bucket=int)

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling so far, stacked and sequential (None: not compiled execution)."""
        if self.programs is None:
            return None
        fused = self.round_program.compile_seconds if self.round_program is not None else 0.0
        return self.programs.compile_seconds + self.sequential.compile_seconds + fused

    def _compiled_rule(self, eager_rule, runtime, params, client_state, ids, broadcast, info, batches, record, loss=None, personal=None):
        """The stacked clients' K steps as one compiled program, S padded up (``padded_clients``: the
        padding repeats the last client and is cut off: a bounded number of variants; the broadcast parameters
        are copied out of their stride-0 views, so padded and unpadded rounds share a program); ``eager_rule``
        for a declared reason (logged once)."""
        reason, listed, cut = compiled_unsupported_reason(runtime, padded=True), None, False
        if reason is None and self._round.padded and type(runtime.algorithm) in self._equal_steps:
            reason = (
                f"{type(runtime.algorithm).__name__} reads ctx.num_steps in its local steps: in rounds of unequal work its stacks of "
                "equal K run eagerly (compiled, each K would be a program of its own)"
            )
        if reason is None:
            if runtime.should_stop():
                raise interrupted(info.round, int(ids[0]), 0, max(self._round.steps))
            size = len(ids)
            padded = padded_clients(size, self._cohort(runtime))
            pad, unpad = functools.partial(_pad_clients, padded - size), functools.partial(_unpad_clients, padded - size)
            mask = self._round.mask  # masked stacking: K and B are padded to powers of two (``_padded``), the mask an input
            masked = () if mask is None else (pad(mask),)
            unit = ("step" if mask is not None else "round") if self.compile_unit == "auto" else None
            sizes = None
            if mask is not None and unit == "step":  # clients in decreasing K (``_buckets``): the stack shrinks as they finish
                sizes = M.stack_sizes(self._round.steps, padded, functools.partial(padded_clients, cohort=self._cohort(runtime)))
            # Once the step program has run (a rule reading the step index runs the round program, on whole batches),
            # step k's batch is drawn for its sizes[k] running clients only, padded as ``pad`` pads a whole batch
            cut = sizes is not None and isinstance(batches, M.StepBatches) and batches.cuts and self._step_program_ran and not self.programs.step_unavailable
            if cut:
                listed = [_pad_clients(n - _stacked_clients(b), b) for n, b in zip(sizes, batches.cut(sizes))]
            else:
                listed = list(batches)
            try:
                new_params, local_state, evaluations = self.programs(
                    (len(listed), padded, False, mask is not None, _stacked_rows(listed[0])), False, runtime.algorithm, runtime.objective, runtime.local.weight_decay,
                    pad({k: v.contiguous() for k, v in params.items()}), pad(client_state), pad(ids), tensor_lr(info), broadcast,
                    pad(personal or {}), listed if cut else pad(listed), pad(None if loss is None else loss.label_counts), *masked, unit=unit, sizes=sizes,
                )  # fmt: skip
            except Uncompilable as error:
                reason = str(error)
            else:
                if sizes is not None and not self.programs.step_unavailable:  # the steps of clients set aside were not computed
                    self._count(0, -_stacked_rows(listed[0]) * M.set_aside(sizes, size))
                for value, out, target, terms in evaluations:  # a shrunk stack's steps evaluate fewer clients: cut, not padded
                    value, out, target, terms = M.leading_rows((value, out, target, terms), 0, size)
                    record.add(value, out, target, terms or None)
                return unpad(new_params), unpad(local_state)
        log_fallback(self.compile_fallbacks, reason, log)
        rest = batches if listed is None or cut else iter(listed)  # a cut draw left the whole batches undrawn
        return eager_rule(runtime, params, client_state, ids, broadcast, info, rest, record, loss, personal)

    @property
    def _step_program_ran(self) -> bool:
        """Whether a stacked step program has run (then the rule does not read the step index)."""
        return any(key[0] == "step" for key in self.programs.variants)

    def _cohort(self, runtime: ClientRuntime) -> int | None:
        """The most clients a stacked program runs when the number sampled per round is fixed
        (``UniformSampling``; at most ``max_stacked_clients``), else None (``padded_clients``)."""
        participation, num_clients = getattr(runtime.data, "participation", None), getattr(runtime.data, "num_clients", None)
        if not isinstance(participation, UniformSampling) or num_clients is None:
            return None
        cohort = participation.count(num_clients)
        return cohort if self.max_stacked_clients is None else min(cohort, self.max_stacked_clients)

    def _vmapped_rule(self, runtime, params, client_state, ids, broadcast, info, batches, record, loss=None, personal=None):
        """A rule with reductions (e.g. FedSAM's gradient norm): run per client under vmap."""
        algorithm, objective, weight_decay = runtime.algorithm, runtime.objective, runtime.local.weight_decay
        counts = None if loss is None else loss.label_counts

        def loss_at(p: TensorDict, batch: Any, bound: Any, padded_rows: bool = self._round.padded_rows) -> tuple[Tensor, tuple[Tensor, Tensor, dict]]:
            if bound is None:
                value, out, target = objective.at(p, batch)
                return value, (out, target, {})
            value, terms, out, target = bound.at(objective, p, batch, padded_rows)
            return value, (out, target, terms)

        def full_grad_fn(full: Any, bound: Any):
            """(one client's) ``ctx.full_grad``: sequential execution's gradient on its whole set, the mean over its real rows."""
            if full is None:
                return _no_full_grad

            def full_grad(p: TensorDict) -> TensorDict:
                g, _ = grad_and_value(loss_at, has_aux=True)(p, full, bound, full_padded)
                return P.add(g, p, weight_decay) if weight_decay else g

            return full_grad

        full_batches, full_padded = self._full_batches(runtime, ids) if type(algorithm) in self._full_gradients else (None, False)
        full_dim = None if full_batches is None else 0

        def bind(cid: Tensor, state: Any, counts: Any) -> Any:
            """The local loss bound to one client (None: the model's own loss)."""
            return None if loss is None else dataclasses.replace(loss, client=cid, client_state=state, label_counts=counts)

        def step_fn(step: int):
            def one_client(params: TensorDict, local_state: Any, state: Any, cid: Tensor, batch: Any, counts: Any, own: TensorDict, full: Any):
                first: list[tuple] = []  # the step's first evaluation: (loss, outputs, targets, terms)
                bound = bind(cid, state, counts)

                def grad(p: TensorDict) -> tuple[Tensor, TensorDict]:
                    g, (value, (out, target, terms)) = grad_and_value(loss_at, has_aux=True)(p, batch, bound)
                    if weight_decay:
                        g = P.add(g, p, weight_decay)
                    if not first:
                        first.append((value, out, target, terms))
                    return value, g

                ctx = self._context(cid, broadcast, state, info, runtime, grad=grad, step=step, personal=own, full_grad=full_grad_fn(full, bound))
                new_params, new_local = algorithm.client_step(params, local_state, ctx)
                return new_params, new_local, first[0] if first else ()  # () : a step without ctx.grad (FedAvg-SVRG's snapshot)

            return vmap(one_client, in_dims=(0, 0, 0, 0, 0, None if counts is None else 0, 0, full_dim), randomness="different")

        def init(p: TensorDict, state: Any, cid: Tensor, own: TensorDict, counts: Any, full: Any) -> Any:
            return algorithm.client_init(p, self._context(cid, broadcast, state, info, runtime, personal=own, full_grad=full_grad_fn(full, bind(cid, state, counts))))

        personal = personal or {}
        init_dims = (0, 0, 0, 0, None if counts is None else 0, full_dim)
        local_state = vmap(init, in_dims=init_dims, randomness="different")(params, client_state, ids, personal, counts, full_batches)
        mask = self._round.mask
        for step, batch in enumerate(batches):
            if runtime.should_stop():
                raise interrupted(info.round, int(ids[0]), step, max(self._round.steps))
            new_params, new_state, evaluation = step_fn(step)(params, local_state, client_state, ids, batch, counts, personal, full_batches)
            if mask is None:
                params, local_state = new_params, new_state
            else:  # a client's padded step changes nothing
                params, local_state = M.keep_where(mask[:, step], (new_params, new_state), (params, local_state))
            if evaluation:  # as in sequential execution, a step records its first ctx.grad's evaluation, if any
                value, out, target, terms = evaluation
                record.add(value, out, target, terms if loss is not None else None)
        return params, local_state

    def _full_batches(self, runtime: ClientRuntime, ids: Tensor) -> tuple[tuple[Tensor, ...], bool]:
        """The stacked clients' whole training sets (``client_full_batch``, as sequential ``ctx.full_grad`` reads them),
        padded to the largest (``masking.padded_full_batches``), on the device; and whether rows were padded."""
        clients, sizes = ids.tolist(), runtime.data.client_sizes[ids]
        padded = bool((sizes != sizes[0]).any())
        if padded:  # the whole sets are padded like a round's batches: the same losses must leave the padded rows out
            _check_losses_ignore_padded_rows(runtime.algorithm, runtime.objective)
        if len(clients) * int(sizes.max()) > FULL_BATCH_ROWS:
            raise Unbatchable(f"the stacked clients' whole sets would hold more than {FULL_BATCH_ROWS} rows (full gradients run client by client)")
        return to_device(M.padded_full_batches([runtime.data.client_full_batch(c) for c in clients]), runtime.device), padded

    def _finish_stacked(self, runtime, params, local_state, stacked_state, ids, broadcast, info, personal) -> tuple[Payload, NestedState]:
        """An elementwise rule's finish once on the stacked tensors: the stacked uploads and new states. Where the
        clients ran different numbers of steps and the finish reads ``ctx.num_steps`` or ``ctx.step`` (e.g. SCAFFOLD's
        control variate), it runs once per distinct K, each client taking its own K's rows (the same values as
        client by client)."""
        steps, size = self._round.steps, len(ids)
        chosen = None
        for k in sorted(set(steps)):
            context = _FinishContext(ids, broadcast, stacked_state, info, k, full_grad=_no_full_grad, data_pass=_no_data_pass, personal=personal)
            context.step = k - 1
            output = finish_client(runtime.algorithm, params, local_state, context)
            _check_stacked(output, size)
            if not context.read:  # the same finish for every K
                return output
            own = torch.tensor([s == k for s in steps], device=runtime.device)
            chosen = output if chosen is None else _take_rows(own, output, chosen)
        return chosen

    def _finish(self, runtime, params, local_state, states, ids, broadcast, info, personal=None) -> tuple[Any, Any]:
        """Every client's (upload, new state): once on the stacked tensors for an elementwise rule that
        does not read ``ctx.client_id`` (stacked ``[S, ...]``), else client by client on the final tensors (once a
        round: cheap; one list per client).

        ``states`` is (the clients' states, the same stacked); ``ctx.step`` is the last step, as in sequential execution.
        With personal tensors (``personal``, stacked), ``client_finish`` sees the shared tensors only and each
        client keeps ``personal_finish``'s values under ``PERSONAL``, as in sequential execution.
        """
        algorithm, (states, stacked_state), steps = runtime.algorithm, states, self._round.steps
        personal = personal or {}
        if declares_capability(algorithm, "elementwise") and type(algorithm) not in self._finish_per_client:
            try:
                return self._finish_stacked(runtime, params, local_state, stacked_state, ids, broadcast, info, personal)
            except ClientIdUnavailable:
                self._finish_per_client.add(type(algorithm))
        states = states if states is not None else unstacked(stacked_state, len(ids))  # each client's view
        if not self._round.equal and any(isinstance(v, Tensor) and (v.dim() == 0 or v.shape[0] != len(states)) for v in _tensor_leaves(local_state)):
            raise Unbatchable("the rule's client_finish runs client by client, and its stacked local state holds a tensor shared by the clients")
        views, local_views = unstacked(params, len(states)), unstacked(local_state, len(states))
        personal_views = unstacked(personal, len(states)) if personal else [{}] * len(states)
        outputs = []
        for i, c in enumerate(ids.tolist()):
            own = _unstack_broadcast(broadcast, i) if self._per_client_x else broadcast
            ctx = self._context(int(c), own, states[i], info, runtime, steps[i], step=steps[i] - 1, personal=personal_views[i])
            ctx.data_pass = data_pass_fn(runtime, int(c))  # client by client here: its whole set, as sequential execution reads it
            outputs.append(finish_client(algorithm, views[i], local_views[i], ctx))
        return [u for u, _ in outputs], [s for _, s in outputs]


def _stacked_small(trees: list[NestedState]) -> NestedState | None:
    """The clients' two-level dicts of tensors stacked ``[S, ...]`` where they hold the same tensors (names, shapes,
    dtypes, devices) and each stacked tensor is small enough that ``P.across`` would stack it anyway (no copy that
    aggregation or the store would not make); else None."""
    first = trees[0]
    for td in first.values():
        if not isinstance(td, dict) or not all(isinstance(v, Tensor) and v.numel() * len(trees) <= P.STACK_LIMIT for v in td.values()):
            return None
    if not all(isinstance(tree, dict) and all(isinstance(td, dict) for td in tree.values()) and same_tensors(first, tree) for tree in trees[1:]):
        return None
    return {n: {k: torch.stack([tree[n][k] for tree in trees]) for k in td} for n, td in first.items()}


def _check_stacked(output: tuple[Payload, NestedState], size: int) -> None:
    """``Unstackable`` unless every tensor of a stacked finish's (upload, new state) holds one row per client."""
    for tree in output:
        for name, td in tree.items():
            if not isinstance(td, dict) or any(not isinstance(v, Tensor) or v.dim() == 0 or v.shape[0] != size for v in td.values()):
                raise Unstackable(f"the rule's client_finish returns {name} not stacked over the clients (one row per client)")


def _take_rows(own: Tensor, new: tuple[Payload, NestedState], old: tuple[Payload, NestedState]) -> tuple[Payload, NestedState]:
    """``old`` with the rows where ``own`` is true taken from ``new`` (the same tensors in both)."""
    if any(a.keys() != b.keys() or any(a[n].keys() != b[n].keys() for n in a) for a, b in zip(new, old)):
        raise Unstackable("the rule's client_finish returns different tensors for clients of different K")
    return M.keep_where(own, new, old)


def _unstack_broadcast(broadcast: Payload, i: int) -> Payload:
    """Client ``i``'s own broadcast from one whose tensor-dict entries are stacked over clients."""
    return {k: {n: t[i] for n, t in v.items()} if isinstance(v, dict) else v for k, v in broadcast.items()}
