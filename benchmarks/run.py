"""Throughput and memory of federated execution against a bare PyTorch FedAvg loop.

    python benchmarks/run.py --out results.json [--quick] [--workloads mlp,mlp400,cnn,lora,mlp_realistic,cnn_realistic,lora_realistic]

Workloads: ``mlp`` (synthetic data, 100 clients, S = 10 and 50), ``mlp400`` (the same
data-per-client and model with 400 clients, S = 200: the issue's "batched at S = 200"
setting; fewer rounds, a round is 20x that of S = 10), ``cnn`` (digits
SmallCNN, 50 clients, S = 20), ``lora`` (the tiny test GPT-2 with LoRA adapters on
SST-2-schema data written locally, 20 clients, S = 5). Every one of these runs K = 4
(LoRA: 2) local SGD steps of batch 16 (LoRA: 8) per client and round: an idealised round,
every client the same work.

Realistic workloads (``benchmarks/realistic.py``): ``mlp_realistic`` (the MLP data and model, S = 50)
and ``cnn_realistic`` (the digits SmallCNN, S = 20) split the data by Dirichlet(0.1) label skew
(100 / 50 clients of 2 to a few hundred samples), train 2 local epochs of batch 32 (K_i = 2 ceil(n_i / 32),
the last batch of a pass short) and make 20 % of the clients stragglers; ``lora_realistic`` (the ``lora`` model and
data, S = 5) does the same with one local epoch of batch 8 over Dirichlet(0.5) text clients (two labels: 0.1 leaves clients empty) (each step's sequences
padded to its longest, as a stacked round pads them). Their bare loop runs the
framework's own schedule (clients, budgets, minibatches), so every execution does the same client-steps.
Their rows also carry ``stacked_fraction`` (the fit's rounds that ran stacked; bare: null, sequential: 0)
and ``padding_waste`` (the share of the stacked work that was padding; null where nothing stacked).

Executions: ``bare`` is the reference, a hand-written sequential FedAvg loop in
this file; ``sequential`` and ``batched`` run FedAvg through ``FederatedModule``
and ``Trainer.fit``; ``ddp2`` is sequential execution with the round's clients
split over 2 DDP processes (gloo); ``one_batch`` (opt-in: ``--executions
bare,one_batch,...``) is the arithmetic floor of batched execution, K plain steps of one
model over the round's S x B rows as one batch (``bare_loop``); ``sequential_compiled``,
``batched_compiled`` and ``one_batch_compiled`` (opt-in) are the same with the K local steps as one
``torch.compile`` program (compiled execution; ``one_batch_compiled``: the ceiling of compiled
batching; compilation falls in the untimed first round, except programs for shapes first met later:
``timed_compile_s``); ``generic_compiled`` (opt-in; mlp, mlp400, cnn) is FedAvg by the generic stacked program, what
``torch.func`` gives any model without a framework: ``vmap`` over the round's clients of ``grad`` of the loss through
``functional_call``, the K steps unrolled under ``torch.compile``, the mean of the clients' models (``_compiled_generic``);
batched rows then carry ``ratio_vs_generic`` (and ``batched_compiled`` rows ``ratio_vs_one_batch_compiled``).
``batched_compiled_round`` is batched compiled execution with ``compile_round``: each round that allows it (equal local
work) as one program, the aggregate and the server step inside it (docs/performance.md, "The compiled round").
``auto`` is ``execution: auto`` (its trial rounds inside the timed rounds, so its cost includes them; rows carry
``auto_choice``, each fit's choice). The local executions of one workload run in
one process, interleaved and repeated (the best of each is kept), so machine noise
hits them alike; ``ratio_vs_bare`` divides a row's client-steps/s by the bare
loop's of the same workload and S in this invocation. The first round of every
run is a warm-up and is not timed. ``peak_rss_mb`` is the process's peak resident
memory during that row (the kernel's high-water mark, reset before each row).

The JSON file (``--out``, default ``benchmarks/results/<cpu>-<cores>cpu-<date>.json``) holds
``{"machine": {cpu, cores, torch, ...}, "date", "quick", "rows": [...]}``; the machine is printed with
the results. Rows: ``{workload, execution, clients_per_round, client_steps_per_s,
peak_rss_mb, ratio_vs_bare}`` (realistic workloads: also ``stacked_fraction, padding_waste``);
``ddp2`` rows also carry ``ratio_vs_sequential``; compiled rows ``compile_s`` (each repeat's seconds
compiling: the first with inductor's on-disk cache as found, later ones in the same process reload it),
``programs_compiled`` and ``timed_compile_s`` (each repeat's seconds compiling after the warm-up round, inside
the timed rounds: programs for shapes first met later, e.g. realistic rounds' new padded sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import realistic  # noqa: E402

LR = 0.05
WORKLOADS = {
    # name: clients, clients-per-round settings, local steps, batch size
    "mlp": dict(num_clients=100, plan=[10, 50], steps=4, batch=16, samples=8000),
    "mlp400": dict(num_clients=400, plan=[200], steps=4, batch=16, samples=32000),  # 64 training samples a client, as mlp
    "cnn": dict(num_clients=50, plan=[20], steps=4, batch=16),
    "lora": dict(num_clients=20, plan=[5], steps=2, batch=8),
    # Opt-in (--workloads resnet18): ResNet-18 (GroupNorm) on CIFAR-shaped random images, minutes on a CPU.
    "resnet18": dict(num_clients=20, plan=[10], steps=1, batch=8),
    # Realistic rounds (benchmarks/realistic.py): Dirichlet(alpha) client sizes, local.epochs passes of
    # batch 32, a fraction of stragglers; the same data and model as mlp / cnn.
    "mlp_realistic": dict(num_clients=100, plan=[50], epochs=2, batch=32, samples=8000, alpha=0.1, straggler=0.2),
    "cnn_realistic": dict(num_clients=50, plan=[20], epochs=2, batch=32, alpha=0.1, straggler=0.2),
    "lora_realistic": dict(num_clients=20, plan=[5], epochs=1, batch=8, alpha=0.5, straggler=0.2),  # two labels: alpha 0.1 leaves clients empty
}
OPT_IN = {"resnet18"}
DEFAULT_WORKLOADS = "mlp,mlp400,cnn,lora,mlp_realistic,cnn_realistic,lora_realistic"
REALISTIC = {w for w, spec in WORKLOADS.items() if "epochs" in spec}


class _Device:
    """The device of every row (``--device``, passed to worker processes as FL_BENCH_DEVICE)."""

    @property
    def type(self) -> str:
        return os.environ.get("FL_BENCH_DEVICE", "cpu")

    def sync(self) -> None:
        if self.type == "cuda":
            import torch

            torch.cuda.synchronize()


DEVICE = _Device()

QUICK_DDP = {("mlp", 50), ("cnn", 20)}  # --quick: the CPU-bound settings only (a DDP launch costs ~15 s)


# ---- memory -----------------------------------------------------------------------------------
def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """The resident-set high-water mark since the last ``reset_peak_rss``, MB."""
    return rss_mb("VmHWM")


def rss_mb(field: str = "VmRSS") -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: now; VmHWM: peak), MB; where
    there is no /proc, the peak resident set of the process's life."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- workloads ----------------------------------------------------------------------------------
def _text_assets() -> Path:
    """SST-2-schema parquet files, a BPE tokenizer trained on them and a tiny random GPT-2 (offline)."""
    from tests.text_fixtures import all_texts, write_glue, write_tiny_gpt2, write_tokenizer

    root = Path(os.environ.get("FL_BENCH_TEXT_DIR") or tempfile.mkdtemp(prefix="fl_bench_text_"))
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "gpt2" / "config.json").exists():
        files = write_glue(root, "sst2", n_train=640, n_eval=32)
        write_tokenizer(root / "tok", all_texts([files]))
        write_tiny_gpt2(root / "gpt2", root / "tok")
    return root


def cifar_shaped(**kwargs):
    """A ``FederatedDataModule`` of Gaussian-class images of CIFAR's shape, 3 x 32 x 32, 10 classes (no download)."""
    from torch.utils.data import TensorDataset

    from datamodules import FederatedDataModule
    from datamodules.sources import DataSource, load_source

    class CifarShaped(FederatedDataModule):
        def build_source(self) -> DataSource:
            flat = load_source("synthetic", num_samples=2000, num_features=3 * 32 * 32, num_classes=10, seed=0)
            images = [TensorDataset(d.tensors[0].view(-1, 3, 32, 32), d.tensors[1]) for d in (flat.train, flat.test)]
            return DataSource(images[0], images[1], flat.train_labels, flat.num_classes)

    return CifarShaped(**kwargs)


def build(workload: str, clients_per_round: int):
    """(model, datamodule) of a workload, seeded: every execution starts from the same model."""
    import torch

    from datamodules import IID, Dirichlet, FederatedDataModule
    from fl_lightning import UniformSampling

    spec = WORKLOADS[workload]
    partition = Dirichlet(spec["alpha"]) if "alpha" in spec else IID()
    common = dict(num_clients=spec["num_clients"], partition=partition, participation=UniformSampling(clients_per_round))
    if workload.startswith("lora"):
        from datamodules import TextDataModule
        from models import LoRAClassifier

        root = _text_assets()
        data = TextDataModule(
            task="sst2", tokenizer=str(root / "tok"), max_length=32, cache_dir=str(root / "cache"),
            data_files={"train": str(root / "sst2_train.parquet"), "validation": str(root / "sst2_validation.parquet")},
            **common,
        )  # fmt: skip
        data.setup()
        torch.manual_seed(0)
        return LoRAClassifier(str(root / "gpt2"), num_labels=2, rank=4, alpha=8, dropout=0.0), data
    from models import MLP, ResNet18, SmallCNN

    if workload == "resnet18":
        data = cifar_shaped(num_clients=spec["num_clients"], partition=IID(), participation=UniformSampling(clients_per_round))
        data.setup()
        torch.manual_seed(0)
        return ResNet18(num_classes=10, norm="group", channels_last=DEVICE.type == "cuda"), data
    if workload.startswith("mlp"):
        data = FederatedDataModule("synthetic", dict(num_samples=spec["samples"], num_features=32, num_classes=10, seed=0), **common)
    else:
        data = FederatedDataModule("digits", {}, **common)
    data.setup()
    torch.manual_seed(0)
    return (MLP(32, 10, hidden=[64]) if workload.startswith("mlp") else SmallCNN()), data


def _compiled_one_batch(model, steps: int):
    """``one_batch``'s K plain SGD steps as one ``torch.compile``d function of the parameters and the
    ``(inputs, targets)`` of the K steps, ``[K, S x B, ...]`` (``torch.func.grad`` of the cross-entropy
    through ``functional_call``): the ceiling of compiled batching, as ``one_batch`` is of eager batching."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad

    def loss_at(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    def k_steps(params, xs, ys):
        for k in range(steps):
            grads = grad(loss_at)(params, xs[k], ys[k])
            params = {n: p - LR * grads[n] for n, p in params.items()}
        return params

    return torch.compile(k_steps, fullgraph=True, dynamic=False)


def _compiled_generic(model, steps: int):
    """The generic stacked program: S clients' K local SGD steps as ``vmap`` over clients of
    ``torch.func.grad`` of the cross-entropy through ``functional_call``, the K steps unrolled, under
    ``torch.compile(dynamic=False, fullgraph=True)``; input ``[S, ...]`` parameters and ``[K, S, B, ...]``
    batches, output the clients' parameters. What any model gets from torch.func without a framework:
    the reference batched execution is measured against (``ratio_vs_generic``)."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    def loss_at(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    step = vmap(grad(loss_at))

    def k_steps(params, xs, ys):
        for k in range(steps):
            grads = step(params, xs[k], ys[k])
            params = {n: p - LR * grads[n] for n, p in params.items()}
        return params

    return torch.compile(k_steps, fullgraph=True, dynamic=False)


def bare_loop(
    workload: str, clients_per_round: int, rounds: int, one_batch: bool = False, compiled: bool = False, generic: bool = False
) -> float:
    """Hand-written sequential FedAvg: copy x in, K SGD steps, accumulate deltas, average.

    ``one_batch`` (the ``one_batch`` execution): each of the K steps is instead one ordinary
    forward/backward/SGD step of the one model over all S clients' minibatches concatenated
    (S x B rows). Not FedAvg: the arithmetic floor of any way of stacking the clients (the same
    rows through the same layers, without per-client parameters), so ``one_batch / bare`` is
    the most batched execution can reach on the machine.

    ``generic`` (the ``generic_compiled`` execution): FedAvg by the generic program
    (``_compiled_generic``): the round's clients stacked, K steps, the mean of their models.

    Returns the seconds of rounds 2..``rounds`` (the first is a warm-up).
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset
    from torch.utils.data import default_collate

    model, data = build(workload, clients_per_round)
    spec = WORKLOADS[workload]
    device = torch.device(DEVICE.type)
    model.to(device)
    if workload in REALISTIC:  # unequal local work: the framework's schedule (one_batch: not defined for it)
        return None if one_batch or compiled or generic else realistic.bare_loop(model, data, spec, rounds, LR, device, DEVICE.sync)
    train = data.source.train
    if isinstance(train, TensorDataset):  # resident on the device, as the framework keeps it
        train = TensorDataset(*(t.to(device) for t in train.tensors))
    collate = data.source.collate_fn or default_collate
    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(0)

    def batch_of(idx):
        if isinstance(train, TensorDataset):
            return tuple(t[idx.to(device)] for t in train.tensors)
        return {k: v.to(device) for k, v in collate([train[int(i)] for i in idx]).items()}

    def loss_of(batch):
        if isinstance(batch, dict):
            out = model(**{k: v for k, v in batch.items() if k != "labels"})
            return F.cross_entropy(getattr(out, "logits", out), batch["labels"])
        return F.cross_entropy(model(batch[0]), batch[1])

    if (compiled or generic) and not isinstance(train, TensorDataset):
        return None  # compiled one_batch and the generic program: in-memory tensor workloads only
    compiled_steps = _compiled_one_batch(model, spec["steps"]) if compiled else None
    generic_steps = _compiled_generic(model, spec["steps"]) if generic else None
    start = None
    for round_idx in range(rounds):
        if round_idx == 1:
            start = time.perf_counter()
        clients = torch.randperm(data.num_clients, generator=generator)[:clients_per_round]
        if generic_steps is not None:
            idx = torch.stack([data.client_train[c][torch.randint(len(data.client_train[c]), (spec["steps"], spec["batch"]), generator=generator)]
                               for c in clients.tolist()], dim=1)  # [K, S, B]  # fmt: skip
            stacked = {n: p.detach().unsqueeze(0).expand(clients_per_round, *p.shape).contiguous() for n, p in model.named_parameters()}
            new = generic_steps(stacked, *batch_of(idx))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(new[n].mean(0))
            continue
        if compiled_steps is not None:
            idx = torch.cat([data.client_train[c][torch.randint(len(data.client_train[c]), (spec["steps"], spec["batch"]), generator=generator)]
                             for c in clients.tolist()], dim=1)  # fmt: skip
            new = compiled_steps({n: p.detach() for n, p in model.named_parameters()}, *batch_of(idx))
            with torch.no_grad():
                for (n, p) in model.named_parameters():
                    p.copy_(new[n])
            continue
        if one_batch:
            for _ in range(spec["steps"]):
                idx = torch.cat([data.client_train[c][torch.randint(len(data.client_train[c]), (spec["batch"],), generator=generator)]
                                 for c in clients.tolist()])  # fmt: skip
                grads = torch.autograd.grad(loss_of(batch_of(idx)), params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(g, alpha=LR)
            continue
        total = [torch.zeros_like(g) for g in global_params]
        for c in clients.tolist():
            idx_all = data.client_train[c]
            with torch.no_grad():
                for p, g in zip(params, global_params):
                    p.copy_(g)
            for _ in range(spec["steps"]):
                idx = idx_all[torch.randint(len(idx_all), (spec["batch"],), generator=generator)]
                grads = torch.autograd.grad(loss_of(batch_of(idx)), params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(g, alpha=LR)
            with torch.no_grad():
                for t, p, g in zip(total, params, global_params):
                    t.add_(p - g)
        with torch.no_grad():
            for g, t in zip(global_params, total):
                g.add_(t, alpha=1.0 / clients_per_round)
    DEVICE.sync()
    return time.perf_counter() - start


def framework(workload: str, clients_per_round: int, rounds: int, execution: str, callbacks: tuple = ()) -> float | None:
    """FedAvg through FederatedModule + Trainer.fit; the seconds of rounds 2..``rounds``.

    ``ddp2``: sequential execution with the round's clients split over 2 DDP processes
    (gloo); returns None on rank 1. ``callbacks``: more Lightning callbacks for the fit.
    """
    import lightning as L

    from fl_lightning import FedAvg, FederatedModule, LocalTraining

    class Timer(L.Callback):
        """From the end of the warm-up round to the end of the last round (no start-up or teardown)."""

        compiled_before = 0.0  # seconds compiling by the end of the warm-up round

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            DEVICE.sync()
            compiling = getattr(module.executor.inner, "compile_seconds", None) or 0.0
            if batch_idx == 0:
                self.start, self.compiled_before = time.perf_counter(), compiling
            elif batch_idx == rounds - 1:
                self.seconds = time.perf_counter() - self.start
                self.compiled_in_timed = compiling - self.compiled_before  # variants first met after the warm-up

    spec = WORKLOADS[workload]
    timer = Timer()
    model, data = build(workload, clients_per_round)
    from fl_lightning.executors import BatchedExecutor, SequentialExecutor

    kwargs = {"execution": execution} if execution in ("batched", "auto") else {}
    if execution.endswith("_compiled") or execution == "batched_compiled_round":
        unit = {"compile_unit": os.environ["FL_BENCH_COMPILE_UNIT"]} if os.environ.get("FL_BENCH_COMPILE_UNIT") else {}
        if os.environ.get("FL_BENCH_STEPS_PER_CALL"):
            unit["steps_per_call"] = int(os.environ["FL_BENCH_STEPS_PER_CALL"])
        if execution == "batched_compiled_round":  # the compiled round: clients, aggregate and server step as one program
            unit["compile_round"] = True
        kwargs = {"execution": (BatchedExecutor if execution.startswith("batched") else SequentialExecutor)(compile=True, **unit)}
    if os.environ.get("FL_BENCH_GC"):  # --gc: the collector freeze after the warm-up round on or off (default: the module's)
        kwargs["gc_freeze"] = os.environ["FL_BENCH_GC"] == "freeze"
    distributed = dict(devices=2, strategy="ddp") if execution == "ddp2" else {}
    if workload in REALISTIC:
        kwargs.update(faults=realistic.faults(spec))
        local = realistic.local_training(spec, LR)
    else:
        local = LocalTraining(lr=LR, steps=spec["steps"], batch_size=spec["batch"])
    module = FederatedModule(model, FedAvg(), local, **kwargs)
    trainer = L.Trainer(
        max_steps=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer, *callbacks],
        accelerator="gpu" if DEVICE.type == "cuda" else "cpu", **distributed,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    if execution == "auto":  # what it chose, from its trial rounds (inside the timed rounds: part of its cost)
        CHOICES.setdefault((workload, execution, clients_per_round), []).append(module.training_executor.choice)
    if workload in REALISTIC:
        STACKING[(workload, execution, clients_per_round)] = realistic.stacking(module.executor, rounds)
    inner = module.executor.inner
    if getattr(inner, "compile_seconds", None) is not None:  # compiled execution: its compile time and programs
        programs = [p for p in (getattr(inner, "programs", None), getattr(getattr(inner, "sequential", None), "programs", None)) if p is not None]
        COMPILES.setdefault((workload, execution, clients_per_round), []).append(
            (round(inner.compile_seconds, 2), sum(p.compiled for p in programs), round(getattr(timer, "compiled_in_timed", 0.0), 2)))
    return timer.seconds if trainer.global_rank == 0 else None


COMPILES: dict[tuple, list] = {}  # (workload, execution, S): (seconds compiling, programs compiled, of them in timed rounds) of each fit
CHOICES: dict[tuple, list] = {}  # (workload, "auto", S): the execution each fit chose
STACKING: dict[tuple, tuple] = {}  # realistic (workload, execution, S): (stacked_fraction, padding_waste) of the last fit
_WORK: dict[tuple, int] = {}


def client_steps(workload: str, clients_per_round: int, rounds: int) -> int:
    """The client-steps of a run's timed rounds: (rounds - 1) x S x K, or a realistic schedule's sum."""
    spec = WORKLOADS[workload]
    if workload not in REALISTIC:
        return (rounds - 1) * clients_per_round * spec["steps"]
    key = (workload, clients_per_round, rounds)
    if key not in _WORK:
        _WORK[key] = realistic.client_steps(realistic.schedule(build(workload, clients_per_round)[1], spec, rounds))
    return _WORK[key]


# ---- one process per workload -------------------------------------------------------------------
def _quiet() -> None:
    import logging

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "fl_lightning.executors.batched", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _best_rows(runs: list[tuple[str, str, int]], rounds: dict[str, int], repeats: int, run_one) -> list[dict]:
    """Run every (workload, execution, S) ``repeats`` times, interleaved within a workload
    (workloads one after another, so none sees the memory of a later one); keep each best rate."""
    best: dict[tuple, float] = {}
    peak: dict[tuple, float] = {}
    groups = {key[0]: [k for k in runs if k[0] == key[0]] for key in runs}
    for key in [k for group in groups.values() for _ in range(repeats) for k in group]:
        workload, execution, s = key
        reset_peak_rss()
        seconds = run_one(workload, execution, s, rounds[workload])
        if seconds is None:  # not rank 0, or no such row (one_batch of a realistic workload)
            continue
        rate = client_steps(workload, s, rounds[workload]) / seconds
        best[key] = max(best.get(key, 0.0), rate)
        peak[key] = max(peak.get(key, 0.0), peak_rss_mb())
    rows = [dict(workload=w, execution=e, clients_per_round=s, client_steps_per_s=best[(w, e, s)],
                 peak_rss_mb=round(peak[(w, e, s)], 1)) for (w, e, s) in runs if (w, e, s) in best]  # fmt: skip
    for row in rows:  # compiled rows: each fit's compile seconds (the first: inductor's cache as found) and programs
        compiles = COMPILES.get((row["workload"], row["execution"], row["clients_per_round"]))
        if compiles:
            row["compile_s"], row["programs_compiled"] = [c for c, _, _ in compiles], compiles[0][1]
            row["timed_compile_s"] = [t for _, _, t in compiles]  # compiling inside the timed rounds (new variants)
        if (row["workload"], row["execution"], row["clients_per_round"]) in CHOICES:
            row["auto_choice"] = CHOICES[(row["workload"], row["execution"], row["clients_per_round"])]
        if row["workload"] in REALISTIC:  # bare: not a federated executor
            stacked, waste = STACKING.get((row["workload"], row["execution"], row["clients_per_round"]), (None, None))
            row["stacked_fraction"] = None if stacked is None else round(stacked, 3)
            row["padding_waste"] = None if waste is None else round(waste, 3)
    return rows


def worker(workloads: list[str], executions: list[str], rounds: dict[str, int], repeats: int) -> list[dict]:
    """bare / sequential / batched rows, all in this process: a workload's executions run
    back to back, so a pass over them sees the same machine state."""
    _quiet()

    def run_one(workload, execution, s, n):
        if execution in ("bare", "one_batch", "one_batch_compiled", "generic_compiled"):
            return bare_loop(workload, s, n, one_batch=execution.startswith("one_batch"), compiled=execution == "one_batch_compiled",
                             generic=execution == "generic_compiled")  # fmt: skip
        return framework(workload, s, n, execution)

    runs = [(w, e, s) for w in workloads for s in WORKLOADS[w]["plan"] for e in executions]
    return _best_rows(runs, rounds, repeats, run_one)


def ddp_rows(settings: list[tuple[str, int]], rounds: dict[str, int], repeats: int) -> list[dict]:
    """ddp2 rows from one 2-process launch (both ranks run this same sequence of fits).

    Before DDP starts, rank 0 measures the same settings in one process (sequential
    execution) as the reference of ``ratio_vs_sequential``: same launch, adjacent in time.
    """
    _quiet()

    def run_one(w, e, s, n):
        return framework(w, s, n, e)

    reference = []
    if os.environ.get("LOCAL_RANK", "0") == "0":  # Lightning starts rank 1 with LOCAL_RANK=1
        reference = _best_rows([(w, "sequential", s) for w, s in settings], rounds, repeats, run_one)
    rows = _best_rows([(w, "ddp2", s) for w, s in settings], rounds, repeats, run_one)
    for row, ref in zip(rows, reference):
        row["one_process_steps_per_s"] = ref["client_steps_per_s"]
    return rows


def _subprocess(args: list[str]) -> list[dict]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT)
    print(f"  ({' '.join(args)}: {time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[") or line.startswith("{")]
    if out.returncode != 0 or not lines:
        print(f"{' '.join(args)} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return []
    result = json.loads(lines[-1])
    return result if isinstance(result, list) else [result]


def _rounds_arg(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}


def machine() -> dict:
    """What the figures were measured on: CPU model, cores, torch version and threads, Python, OS."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return dict(cpu=model, cores=os.cpu_count(), torch=torch.__version__, torch_threads_per_process=1,
                python=platform.python_version(), os=f"{platform.system()} {platform.release()}")  # fmt: skip


def default_out(info: dict, quick: bool, prefix: str = "") -> str:
    """``benchmarks/results/[<prefix>-]<cpu>-<cores>cpu[-quick]-<date>.json``: results named by machine and date."""
    cpu = "-".join("".join(c if c.isalnum() else " " for c in info["cpu"].lower()).split())[:40] or "cpu"
    head = f"{prefix}-" if prefix else ""
    return f"benchmarks/results/{head}{cpu}-{info['cores']}cpu{'-quick' if quick else ''}-{time.strftime('%Y-%m-%d')}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its workloads checked (an unknown one: exit code 2)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<cpu>-<cores>cpu-<date>.json")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repeats: the whole run in a few minutes")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"any of {', '.join(WORKLOADS)} ({', '.join(sorted(OPT_IN))}: opt-in)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every row runs (ddp2 rows: cpu only)")
    parser.add_argument(
        "--executions", default="bare,sequential,batched,ddp2",
        help="any of bare, sequential, batched, auto, ddp2, sequential_compiled, batched_compiled, batched_compiled_round "
        "(opt-in: one_batch, one_batch_compiled, generic_compiled)",
    )  # fmt: skip
    parser.add_argument("--rounds", default=None, help="rounds of a run per workload, e.g. mlp=10,cnn=4 (default: by --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each row, the best kept (default: 2 with --quick, else 3)")
    parser.add_argument("--compile-unit", choices=["auto", "step", "round"], default=None, help="compiled rows' compile_unit (default: each executor's)")
    parser.add_argument("--steps-per-call", type=int, choices=[1, 2], default=None, help="compiled rows' steps_per_call (default: 1)")
    parser.add_argument("--gc", choices=["freeze", "default"], default=None,
                        help="the framework's rows: gc.freeze() after the warm-up round, or Python's collector as is (default: the module's)")
    parser.add_argument("--_worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--_ddp", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args._worker:
        workloads, executions, rounds, repeats = args._worker
        print(json.dumps(worker(workloads.split(","), executions.split(","), _rounds_arg(rounds), int(repeats))))
        return
    if args._ddp:
        settings = [(w, int(s)) for w, s in (item.split(":") for item in args._ddp[0].split(","))]
        rows = ddp_rows(settings, _rounds_arg(args._ddp[1]), int(args._ddp[2]))
        if rows:  # rank 0 only
            print(json.dumps(rows))
        return

    workloads = args.workloads.split(",")
    os.environ["FL_BENCH_DEVICE"] = args.device
    if args.compile_unit:
        os.environ["FL_BENCH_COMPILE_UNIT"] = args.compile_unit
    if args.steps_per_call:
        os.environ["FL_BENCH_STEPS_PER_CALL"] = str(args.steps_per_call)
    if args.gc:
        os.environ["FL_BENCH_GC"] = args.gc
    rounds = ({"mlp": 16, "mlp400": 6, "cnn": 8, "lora": 4, "resnet18": 3, "mlp_realistic": 16, "cnn_realistic": 10, "lora_realistic": 4} if args.quick
              else {"mlp": 40, "mlp400": 10, "cnn": 15, "lora": 10, "resnet18": 4, "mlp_realistic": 25, "cnn_realistic": 15, "lora_realistic": 10})  # fmt: skip
    rounds.update(_rounds_arg(args.rounds) if args.rounds else {})
    rounds_arg = ",".join(f"{k}={v}" for k, v in rounds.items())
    repeats = args.repeats or (2 if args.quick else 3)
    executions = args.executions.split(",")
    local = [e for e in executions if e != "ddp2"]
    if "bare" not in local:
        local.insert(0, "bare")
    started = time.perf_counter()
    if any(w.startswith("lora") for w in workloads):  # written once, read by every process of the run
        _quiet()
        os.environ["FL_BENCH_TEXT_DIR"] = str(_text_assets())
    rows = _subprocess(["--_worker", ",".join(workloads), ",".join(local), rounds_arg, str(repeats)])
    if "ddp2" in executions and args.device == "cpu":
        settings = [(w, s) for w in workloads if w not in OPT_IN for s in WORKLOADS[w]["plan"] if not args.quick or (w, s) in QUICK_DDP]
        if settings:
            rows += _subprocess(["--_ddp", ",".join(f"{w}:{s}" for w, s in settings), rounds_arg, str(repeats)])
    for row in rows:
        same = {r["execution"]: r["client_steps_per_s"] for r in rows
                if (r["workload"], r["clients_per_round"]) == (row["workload"], row["clients_per_round"])}  # fmt: skip
        row["ratio_vs_bare"] = round(row["client_steps_per_s"] / same["bare"], 3) if "bare" in same else None
        if row["execution"].startswith("batched") and "generic_compiled" in same:
            row["ratio_vs_generic"] = round(row["client_steps_per_s"] / same["generic_compiled"], 3)
        if row["execution"] in ("batched_compiled", "batched_compiled_round") and "one_batch_compiled" in same:
            row["ratio_vs_one_batch_compiled"] = round(row["client_steps_per_s"] / same["one_batch_compiled"], 3)
        if row["execution"] == "ddp2" and "one_process_steps_per_s" in row:
            row["ratio_vs_sequential"] = round(row["client_steps_per_s"] / row.pop("one_process_steps_per_s"), 3)
    rows.sort(key=lambda r: (workloads.index(r["workload"]), r["clients_per_round"]))
    for row in rows:
        row["client_steps_per_s"] = round(row["client_steps_per_s"], 1)
        extra = f"  (x{row['ratio_vs_sequential']} of sequential)" if "ratio_vs_sequential" in row else ""
        if "ratio_vs_generic" in row:
            extra += f"  ({row['ratio_vs_generic']:.0%} of generic)"
        if row.get("stacked_fraction") is not None:
            waste = "-" if row["padding_waste"] is None else f"{row['padding_waste']:.0%}"
            extra += f"  stacked {row['stacked_fraction']:.0%}, padding waste {waste}"
        if row.get("auto_choice"):
            extra += f"  chose {', '.join(row['auto_choice'])}"
        print(f"{row['workload']:13s} {row['execution']:10s} S={row['clients_per_round']:3d} "
              f"{row['client_steps_per_s']:10.1f} steps/s {row['peak_rss_mb']:8.1f} MB  x{row['ratio_vs_bare']}{extra}")  # fmt: skip
    info = machine()
    print(f"total {time.perf_counter() - started:.0f} s on {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
          f"(1 thread per process), Python {info['python']}, {info['os']}")  # fmt: skip
    out = Path(args.out or default_out(info, args.quick))
    out.parent.mkdir(parents=True, exist_ok=True)
    compiled = {k: v for k, v in (("compile_unit", args.compile_unit), ("steps_per_call", args.steps_per_call), ("gc", args.gc)) if v}  # (defaults: left out)
    out.write_text(json.dumps({"machine": info, "date": time.strftime("%Y-%m-%d %H:%M"), "quick": args.quick, **compiled, "rows": rows}, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
