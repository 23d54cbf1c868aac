"""Sequential execution: the round's clients train one after another on the one model.

Each client starts from the broadcast parameters (rules are pure functions, so no
copy is made) and its stored state; no per-client model copies exist.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from fl_lightning.core import params as P
from fl_lightning.algorithms.base import ClientContext, ClientIdUnavailable, RoundInfo
from fl_lightning.core.client_data import batch_targets
from fl_lightning.executors.dpsgd import client_noise, dp_sampler, private_grad_fn, private_steps
from fl_lightning.core.errors import FLError, interrupted
from fl_lightning.executors.base import ClientRuntime, Executor, check_loss, data_pass_fn, finish_client, seed_client, to_device
from fl_lightning.executors.compiled import (
    DEFAULT_MAX_VARIANTS, CompiledPrograms, Uncompilable, check_compile_unit, check_steps_per_call, log_fallback, tensor_lr,
)
from fl_lightning.core.local_loss import client_loss
from fl_lightning.core.objective import StepRecord, round_means
from fl_lightning.reliability.faults import TRANSIENT_ERRORS, ClientError, fatal_client_error
from fl_lightning.core.params import TensorDict
from fl_lightning.core.tasks import ClientResult, ClientState, ClientTask

log = logging.getLogger(__name__)


class SequentialExecutor(Executor):
    """Train the tasks' clients one after another.

    Args:
        compile: run each client's K local steps as one compiled program (``torch.compile``; see
            ``fl_lightning.executors.compiled`` and docs/performance.md). Results equal eager
            execution's to float tolerance; rules or models that cannot be compiled run eagerly
            (a declared, logged reason).
        max_variants: with ``compile``, the most compiled programs (shapes) before running eagerly.
        backend: with ``compile``, ``torch.compile``'s backend: ``inductor`` (generated kernels), or
            ``aot_eager`` (traced and differentiated, run by eager kernels: quick to compile, for checks).
        compile_unit: with ``compile``, what one program is: ``"step"`` (one local step, called K times;
            ``client_init`` eager), ``"round"`` (``client_init`` and the K steps unrolled: fewer calls,
            a compile time growing with K) or ``"auto"`` (the default: ``"round"`` with ``local.steps``, whose
            rounds are faster, 1.5-1.9x the bare loop on the MLP workloads against 1.1-1.3x; ``"step"`` with
            ``local.epochs``, where each client's K differs and a pass's last batch is short: one static and one
            dynamic step program serve every client). ``"step"`` compiles in about half the time, which pays on
            short runs (``configs/quickstart_compiled.yaml``; docs/performance.md). A rule whose ``client_step``
            reads ``ctx.step`` or ``ctx.num_steps`` runs the round program (declared, logged once).
        steps_per_call: with ``compile`` and the step unit (``local.epochs``), 1 (the default) or 2: two consecutive
            batches of the same shape as one call of the pair program (fewer calls, each paying dynamo's and AOT's
            entry, for one more program per batch shape that pairs; docs/performance.md, "Two steps a call").
    """

    def __init__(
        self, compile: bool = False, max_variants: int = DEFAULT_MAX_VARIANTS, backend: str = "inductor", compile_unit: str = "auto",
        steps_per_call: int = 1,
    ) -> None:
        self.compile = _check_compile_settings(compile, max_variants, backend, compile_unit, steps_per_call)
        self.max_variants = max_variants
        self.programs = CompiledPrograms(
            stacked=False, max_variants=max_variants, backend=backend, unit=compile_unit, steps_per_call=steps_per_call
        ) if compile else None  # fmt: skip
        self.fallbacks: Counter[str] = Counter()  # compiled execution: clients run eagerly, by reason

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling so far (None: not compiled execution)."""
        return self.programs.compile_seconds if self.programs is not None else None

    def run(self, tasks: Sequence[ClientTask], info: RoundInfo, runtime: ClientRuntime) -> list[ClientResult]:
        """Every task trained in turn under the client-failure policy (``run_task``)."""
        results, records = [], []
        train = self._train_compiled if self.programs is not None else _train_client
        drawn = round_draws(tasks, runtime)
        for task in tasks:
            result = _run_with_policy(task, info, runtime, records, functools.partial(train, drawn=drawn.get(id(task))))
            if result is not None:
                results.append(result)
        return _with_means(results, records, info)

    def _train_compiled(self, task: ClientTask, info: RoundInfo, runtime: ClientRuntime, record: StepRecord, drawn=None) -> ClientResult:
        return _train_compiled_or_eager(self.programs, self.fallbacks, task, info, runtime, record, drawn)


def round_draws(tasks: Sequence[ClientTask], runtime: ClientRuntime) -> dict[int, Iterator]:
    """Each trained task's batches (by ``id(task)``) from one draw for the round's clients (the data's
    ``round_client_batches``: the batches ``client_batches`` gives, one batched sort instead of one per client);
    empty where the data has no such draw (each client then draws its own)."""
    round_batches = getattr(runtime.data, "round_client_batches", None)
    trained = [t for t in tasks if not t.warmup]
    if round_batches is None or runtime.record_privacy is not None or not trained:
        return {}
    local = runtime.local
    drawn = round_batches(
        [t.client_id for t in trained], [t.seed for t in trained], local.batch_size, local.steps, local.epochs, [t.num_steps for t in trained]
    )
    return {} if drawn is None else {id(t): batches for t, batches in zip(trained, drawn)}


def run_task(task: ClientTask, info: RoundInfo, runtime: ClientRuntime) -> ClientResult | None:
    """One client's task, trained the reference way (its loss and accuracy read at once), under the
    documented client-failure policy: None where the client failed and is left out of the round.

    A client that fails (``ClientFailure`` or a transient error, see ``fl_lightning.reliability.faults``) is left
    out, with a warning, unless ``runtime.fail_fast`` (then ``ClientError`` stops the run); a
    ``ValueError`` (a bad setting), an ``FLError`` and any error of the warm-up pass propagate; any
    other error stops the run as ``FatalClientError`` (it is not a client fault). Custom executors
    call it per task; it is not thread-safe: clients share ``runtime.objective``'s model (see
    docs/architecture.md, "An executor").
    """
    records = []
    result = _run_with_policy(task, info, runtime, records)
    return None if result is None else _with_means([result], records, info)[0]


def _run_with_policy(task: ClientTask, info: RoundInfo, runtime: ClientRuntime, records: list, train=None) -> ClientResult | None:
    try:
        return _run(task, info, runtime, records, train)
    except (ValueError, FLError):
        raise
    except TRANSIENT_ERRORS as error:
        if task.warmup:
            raise ClientError(f"warm-up: client {task.client_id} failed: {error!r}; the warm-up pass needs every client") from error
        if runtime.fail_fast:
            raise ClientError(
                f"round {info.round}: client {task.client_id} failed: {error!r}; faults.fail_fast stops the run at the first "
                "client failure (unset it to leave failed clients out of their round)"
            ) from error
        log.warning("round %d: client %d failed and is left out of the aggregate: %r", info.round, task.client_id, error)
        return None
    except Exception as error:
        raise fatal_client_error(info.round, task.client_id, error) from error


def _run(task: ClientTask, info: RoundInfo, runtime: ClientRuntime, records: list, train=None) -> ClientResult:
    if task.warmup:
        return _warmup_client(task, info, runtime)
    record = StepRecord()
    result = (train or _train_client)(task, info, runtime, record)
    records.append((result, record))
    return result


def _with_means(results: list[ClientResult], records: list, info: RoundInfo) -> list[ClientResult]:
    """Fill in the trained clients' mean loss and accuracy, read for all of them at once (``round_means``);
    a recorded non-finite loss is divergence."""
    for (result, record), (loss, accuracy) in zip(records, round_means([r for _, r in records])):
        if record.losses:
            check_loss(info.round, result.client_id, loss)
        result.mean_loss, result.accuracy, result.loss_terms = loss, accuracy, record.term_means()
    return results


def _train_client(task: ClientTask, info: RoundInfo, runtime: ClientRuntime, record: StepRecord, drawn=None) -> ClientResult:
    """Train one client; its loss and accuracy are in ``record`` (read by ``_with_means``). ``drawn``: its batches,
    drawn with the round's other clients (``round_draws``), else drawn here."""
    algorithm, objective, data, local, device = runtime.algorithm, runtime.objective, runtime.data, runtime.local, runtime.device
    cid, broadcast = task.client_id, task.broadcast
    seed_client(task.seed, device)
    client_state, personal = task.load_state()
    loss = client_loss(algorithm, cid, broadcast, client_state, info, data, device)  # None: the model's own loss

    def full_grad(params: TensorDict) -> TensorDict:
        return objective.grad_fn(to_device(data.client_full_batch(cid), device), local.weight_decay, loss=loss)(params)[1]

    ctx = ClientContext(
        cid, broadcast, client_state, info, task.num_steps, full_grad=full_grad, personal=personal, data_pass=data_pass_fn(runtime, cid)
    )
    params = {**broadcast["x"], **personal}  # personal tensors train beside the shared ones and never leave
    local_state = algorithm.client_init(params, ctx)
    dp = runtime.record_privacy
    if dp is not None:  # record-level DP-SGD: its own draws, (RDP.1) in place of the minibatch gradient
        batches = private_steps(data, [cid], [dp_sampler(dp, cid, task.seed)], task.num_steps, stacked=False)
        noise, denominators = client_noise(dp, [cid], [task.seed])
    else:
        batches = drawn if drawn is not None else data.client_batches(cid, task.seed, local.batch_size, local.steps, local.epochs)
    for step, batch in zip(range(task.num_steps), batches):  # a straggler's budget stops it early
        if runtime.should_stop():
            raise interrupted(info.round, cid, step, task.num_steps)
        ctx.step = step
        if dp is not None:
            ctx.grad = private_grad_fn(
                objective, batch.to(device), noise, denominators[0], dp.clip_norm, local.weight_decay, record, loss, name=type(algorithm).__name__
            )
        else:
            ctx.grad = objective.grad_fn(to_device(batch, device), local.weight_decay, record, loss=loss)
        params, local_state = algorithm.client_step(params, local_state, ctx)
    upload, new_state = finish_client(algorithm, params, local_state, ctx)
    return ClientResult(cid, upload, new_state, task.num_steps, math.nan)


def personalize_client(
    params: TensorDict, client_id: int, seed: int, state: ClientState, x: TensorDict, info: RoundInfo, runtime: ClientRuntime
) -> TensorDict:
    """Evaluation's adaptation of a client's prediction parameters (docs/algorithms.md (25.2)): the algorithm's
    ``personalize_step`` on ``personalize_steps`` of the client's training batches, drawn from ``seed``."""
    algorithm, objective, data, local, device = runtime.algorithm, runtime.objective, runtime.data, runtime.local, runtime.device
    seed_client(seed, device)
    steps = algorithm.personalize_steps
    ctx = ClientContext(client_id, {"x": x}, state.algorithm, info, steps, personal=state.personal)
    batches = data.client_batches(client_id, seed, local.batch_size, steps, None)
    for step, batch in zip(range(steps), batches):
        ctx.step = step
        ctx.grad = objective.grad_fn(to_device(batch, device), local.weight_decay)
        params = algorithm.personalize_step(params, ctx)
    return {k: v.detach() for k, v in params.items()}


def _warmup_client(task: ClientTask, info: RoundInfo, runtime: ClientRuntime) -> ClientResult:
    """The algorithm's ``client_warmup`` (e.g. Scaffold-P's c_i^0 from K fresh minibatches)."""
    algorithm, objective, data, local, device = runtime.algorithm, runtime.objective, runtime.data, runtime.local, runtime.device
    cid, x = task.client_id, task.broadcast["x"]
    seed_client(task.seed, device)

    def mean_grad(params: TensorDict) -> TensorDict:
        batches = data.client_batches(cid, task.seed, local.batch_size, local.steps, local.epochs)
        return P.mean([objective.grad_fn(to_device(b, device), local.weight_decay)(params)[1] for b in batches])

    client_state, personal = task.load_state()
    ctx = ClientContext(cid, task.broadcast, client_state, info, task.num_steps, personal=personal, mean_grad=mean_grad)
    upload, new_state = algorithm.client_warmup({**P.detach_clone(x), **P.detach_clone(personal)}, ctx)
    return ClientResult(cid, upload, new_state, task.num_steps, math.nan)  # personal tensors unchanged: not stored


# ---- compiled execution (``compile=True``) -------------------------------------------------------
def _check_compile_settings(compile: bool, max_variants: int, backend: str, compile_unit: str, steps_per_call: int) -> bool:
    if type(compile) is not bool:
        raise ValueError(f"execution.compile must be true or false, got {compile!r}")
    check_compile_unit(compile_unit)
    check_steps_per_call(steps_per_call)
    if type(max_variants) is not int or max_variants < 1:
        raise ValueError(f"execution.max_variants must be an integer >= 1, got {max_variants!r}")
    if compile and backend != "inductor":  # torch.compile's default, always there (listing the backends costs ~0.2 s)
        backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in backends:
            raise ValueError(f"execution.backend must be one of {sorted(backends)}, got {backend!r}")
    return compile


def compiled_unsupported_reason(runtime: ClientRuntime, padded: bool = False, step_unit: bool = False) -> str | None:
    """Why client training cannot run compiled (known before running), or None. ``padded``: stacked clients
    padded to one K and B (masked stacking), which compiles ``local.epochs`` rounds too; ``step_unit``: the step
    program is available (``compile_unit`` auto or step), which runs ``local.epochs`` whatever each client's K."""
    if runtime.record_privacy is not None:
        return "record-level DP-SGD (record_privacy) draws variable batches and per-example gradients, not compiled yet"
    if runtime.local.steps is None and not (padded or step_unit):
        return (
            "local.epochs gives clients different numbers of steps and a short last batch, and compile_unit: round compiles "
            "a program per K; use compile_unit: auto or step"
        )
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled(runtime.device.type):
        return "mixed precision (autocast) is not compiled"
    return None


def _train_compiled_or_eager(
    programs: CompiledPrograms, fallbacks: Counter, task: ClientTask, info: RoundInfo, runtime: ClientRuntime, record: StepRecord,
    drawn: Iterator | None = None,
) -> ClientResult:
    """``_train_client`` with the local steps compiled (``programs.unit``); eager for a declared reason (logged once),
    drawing its batches again (the compiled attempt may have read ``drawn``)."""
    reason = compiled_unsupported_reason(runtime, step_unit=programs.step_unit_available)
    if reason is None:
        try:
            return train_client_compiled(programs, task, info, runtime, record, drawn)
        except Uncompilable as error:
            reason = str(error)
        except ClientIdUnavailable:  # the program's client is a tensor input (an int would recompile per client)
            reason = f"{type(runtime.algorithm).__name__} reads ctx.client_id in its local steps"
    log_fallback(fallbacks, reason, log)
    return _train_client(task, info, runtime, record)


def train_client_compiled(
    programs: CompiledPrograms, task: ClientTask, info: RoundInfo, runtime: ClientRuntime, record: StepRecord, drawn: Iterator | None = None
) -> ClientResult:
    """One client trained by the compiled programs of its local steps (``fl_lightning.executors.compiled``); ``drawn``
    as for ``_train_client``."""
    algorithm, data, local, device = runtime.algorithm, runtime.data, runtime.local, runtime.device
    cid, broadcast, steps = task.client_id, task.broadcast, task.num_steps
    if runtime.should_stop():
        raise interrupted(info.round, cid, 0, steps)
    seed_client(task.seed, device)
    client_state, personal = task.load_state()
    drawn = drawn if drawn is not None else data.client_batches(cid, task.seed, local.batch_size, local.steps, local.epochs)
    batches = [to_device(b, device) for b in itertools.islice(drawn, steps)]
    # a client smaller than the batch (its whole set) or text (each batch as wide as its longest sequence): dynamic
    short = _rows(batches[0]) < local.batch_size or _padded_per_batch(batches[0])
    key, unit = (steps, short), None
    if local.steps is None:  # local.epochs: the step program, a pass's short last batch on its dynamic variant
        short, unit = [local.batch_size is None or _rows(b) < local.batch_size or _padded_per_batch(b) for b in batches], "step"
    batches = [_own_storage(b) if s else b for b, s in zip(batches, short if isinstance(short, list) else [short] * len(batches))]
    params = {**broadcast["x"], **personal}
    client = torch.tensor(cid)
    bound = client_loss(algorithm, cid, broadcast, client_state, info, data, device)
    params, local_state, evaluations = programs(
        key, short, algorithm, runtime.objective, local.weight_decay, params, client_state, client, tensor_lr(info), broadcast, personal, batches,
        None if bound is None else bound.label_counts, unit=unit,
    )  # fmt: skip
    for loss, out, target, terms in evaluations:
        record.add(loss, out, target, terms or None)
    ctx = ClientContext(cid, broadcast, client_state, info, steps, personal=personal, step=steps - 1, data_pass=data_pass_fn(runtime, cid))
    upload, new_state = finish_client(algorithm, params, local_state, ctx)
    return ClientResult(cid, upload, new_state, steps, math.nan)


def _padded_per_batch(batch: Any) -> bool:
    """Whether ``batch`` holds sequences padded to its own longest (an ``attention_mask``: text). Its width changes from
    batch to batch, so it runs the dynamic variant: a static program compiled once per width, until ``max_variants``
    sent the run eager (6 graphs in 4 rounds of ``lora_realistic`` against 2)."""
    return isinstance(batch, dict) and "attention_mask" in batch


def _own_storage(batch: Any) -> Any:
    """A batch for a dynamic program: its tensors copied where they are views. A view into the round's gathered
    block brings its storage offset and its base's size into the program's guards, and every new offset or base
    size compiled the program again (8 graphs instead of 4 on ``cnn_realistic``, docs/performance.md)."""
    return apply_to_collection(batch, torch.Tensor, lambda t: t.clone() if t._base is not None else t)


def _rows(batch) -> int:
    """The number of samples of a batch (its target's first dimension)."""
    return batch_targets(batch).shape[0]
