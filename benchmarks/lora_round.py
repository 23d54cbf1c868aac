"""Memory and time of a federated LoRA round (GPT-2 + peft), sequential vs batched, offline.

Runs ``--rounds`` federated rounds (timing those after the first) on the tiny test GPT-2 (or a randomly initialised GPT-2-small-shaped
model, 124M parameters, ``--size small``) with S clients per round and prints JSON: a round's
time (the training step only, no start-up), peak memory growth during the last round (CPU: resident
set high-water mark; CUDA: allocator peak), bytes of the base, the adapters and the client store,
and the reference ``total_batch_fwd_bwd_s``: one forward/backward of the model over all S clients'
rows as one batch (the arithmetic a batched round cannot go below).

    PYTHONPATH=$PWD python benchmarks/lora_round.py --clients-per-round 5 --execution batched
    PYTHONPATH=$PWD python benchmarks/lora_round.py --size small --sweep 1,5,10 --rounds 1 --steps 1 --batch-size 2 --max-length 128

``--sweep`` runs every S of the list with sequential and batched execution, each in its own
process (peak memory only grows within a process), sharing one set of written assets, prints a
table and writes ``benchmarks/results/lora-<size>-<machine>-<date>.json``. ``--max-stacked 2,5``
adds batched rows stacking at most 2 (5) clients at a time. ``--device cuda`` runs on the GPU.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import default_out, machine, reset_peak_rss, rss_mb  # noqa: E402


def _long_texts(path: Path, n: int, words: int) -> dict[str, str]:
    """SST-2-schema parquet files whose sentences have about ``words`` words (to fill max_length)."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    vocab = ["good", "bad", "movie", "plot", "actor", "the", "a", "was", "very", "scene", "story", "film"]
    files = {}
    for split in ("train", "validation"):
        labels = rng.integers(0, 2, size=n)
        text = [" ".join(rng.choice(vocab, size=words)) for _ in range(n)]
        files[split] = str(path / f"{split}.parquet")
        pd.DataFrame({"sentence": text, "label": labels, "idx": np.arange(n)}).to_parquet(files[split])
    return files


def write_assets(root: Path, size: str, n: int, words: int) -> dict[str, str]:
    """Data files, tokenizer and base model under ``root`` (written once, reused by a sweep's processes)."""
    import pandas as pd

    from tests.text_fixtures import write_tiny_gpt2, write_tokenizer

    marker = root / "assets.json"
    if marker.exists():
        return json.loads(marker.read_text())
    root.mkdir(parents=True, exist_ok=True)
    files = _long_texts(root, n=n, words=words)
    write_tokenizer(root / "tok", pd.read_parquet(files["train"])["sentence"].tolist()[:200], vocab_size=300)
    if size == "tiny":
        write_tiny_gpt2(root / "gpt2", root / "tok")
    else:  # GPT-2 small's shape (124M parameters), random weights: no download
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(eos_token_id=0, bos_token_id=0)).save_pretrained(str(root / "gpt2"))
    marker.write_text(json.dumps(files))
    return files


def one_round(args) -> dict:
    """One round of ``args.clients_per_round`` clients, measured (see the module docstring)."""
    import lightning as L
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    from datamodules import IID, TextDataModule
    from fl_lightning import FederatedModule, LocalTraining, UniformSampling
    from fl_lightning.core import params as P
    from fl_lightning.algorithms import Algorithm
    from fl_lightning.executors import BatchedExecutor
    from models import LoRAClassifier

    class AdamLikeState(Algorithm):
        """Local SGD with two adapter-sized client-state tensors (the footprint of FedIT-AdamGT: v_i, y_i)."""

        elementwise = True

        def client_state_init(self, x):
            return {"v": P.zeros_like(x), "y": P.zeros_like(x)}

        def client_step(self, params, local, ctx):
            _, grad = ctx.grad(params)
            return P.add(params, grad, -ctx.lr), local

    root = Path(args.assets or tempfile.mkdtemp(prefix="lora_bench_"))
    files = write_assets(root, args.size, args.num_clients * args.batch_size * args.steps, args.max_length)
    data = TextDataModule(
        task="sst2", tokenizer=str(root / "tok"), data_files=files, cache_dir=str(root / "cache"),
        max_length=args.max_length, num_clients=args.num_clients, partition=IID(),
        participation=UniformSampling(args.clients_per_round),
    )  # fmt: skip
    data.setup()
    torch.manual_seed(0)
    model = LoRAClassifier(str(root / "gpt2"), num_labels=2, rank=8, alpha=16, dropout=0.05)
    grouped = args.execution == "batched" and args.max_stacked
    module = FederatedModule(
        model=model, algorithm=AdamLikeState(), local=LocalTraining(lr=1e-3, steps=args.steps, batch_size=args.batch_size),
        execution=BatchedExecutor(max_stacked_clients=int(args.max_stacked)) if grouped else args.execution,
    )  # fmt: skip
    cuda = args.device == "cuda"

    class RoundTimer(L.Callback):
        """The training steps after the first (all of them if there is one), and the peak memory of the
        rounds above what the process held when training started (model, data and store set up)."""

        seconds: list[float] = []

        def on_train_start(self, trainer, pl_module):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.before = torch.cuda.memory_allocated() / 2**20
            else:
                reset_peak_rss()
                self.before = rss_mb("VmRSS")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            if batch_idx > 0 or args.rounds == 1:
                self.seconds.append(time.perf_counter() - self.start)
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb("VmHWM")
            self.growth = peak - self.before

    timer = RoundTimer()
    trainer = L.Trainer(
        max_steps=args.rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, accelerator="gpu" if cuda else "cpu", devices=1,
        default_root_dir=str(root), callbacks=[timer], precision=args.precision,
    )  # fmt: skip
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    adapter_bytes = P.num_bytes(module.global_params().values())
    trainer.fit(module, datamodule=data)
    round_s = sum(timer.seconds) / len(timer.seconds)
    fallbacks = dict(getattr(getattr(module.executor, "inner", module.executor), "fallbacks", {}) or {})
    store = module.store.state_dict()

    # The reference: one forward/backward over all S clients' rows as one ordinary batch.
    clients = list(range(args.clients_per_round))
    rows = [next(data.client_batches(c, seed=c, batch_size=args.batch_size, steps=1)) for c in clients]
    width = max(b["input_ids"].shape[-1] for b in rows)
    total = {k: torch.cat([torch.nn.functional.pad(b[k], (0, width - b[k].shape[-1])) if b[k].dim() == 2 else b[k] for b in rows])
             for k in rows[0]}  # fmt: skip
    total = {k: v.to(module.device) for k, v in total.items()}
    grad = module.objective.grad_fn(total, 0.0)
    autocast = torch.autocast(module.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    with autocast:
        grad(module.global_params())  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with autocast:
        for _ in range(args.repeats):
            grad(module.global_params())
    if cuda:
        torch.cuda.synchronize()
    total_s = (time.perf_counter() - t0) / args.repeats
    return {
        "size": args.size,
        "execution": args.execution,
        "max_stacked_clients": int(args.max_stacked) if grouped else None,
        "device": args.device,
        "precision": args.precision,
        "clients_per_round": args.clients_per_round,
        "local_steps": args.steps,
        "batch": [args.batch_size, args.max_length],
        "threads": torch.get_num_threads(),
        "fallbacks": fallbacks,
        "base_MiB": round(base_bytes / 2**20, 3),
        "adapter_KiB": round(adapter_bytes / 2**10, 2),
        "store_KiB": round(P.num_bytes(store.values()) / 2**10, 2),
        "peak_growth_in_rounds_MiB": round(timer.growth, 1),
        "rounds": args.rounds,
        "round_s": round(round_s, 4),
        "round_s_per_client_step": round(round_s / (args.clients_per_round * args.steps), 5),
        "total_batch_fwd_bwd_s": round(total_s, 4),
        "round_over_total_batch_steps": round(round_s / (args.steps * total_s), 3),
    }


def sweep(args) -> None:
    """Every S of ``--sweep`` with sequential and batched execution, one process each."""
    assets = Path(args.assets or tempfile.mkdtemp(prefix="lora_bench_"))
    sizes = [int(s) for s in args.sweep.split(",")]
    write_assets(assets, args.size, args.num_clients * args.batch_size * args.steps, args.max_length)
    passthrough = ["--size", args.size, "--num-clients", str(args.num_clients), "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--max-length", str(args.max_length), "--device", args.device,
                   "--precision", args.precision, "--rounds", str(args.rounds), "--threads", str(args.threads), "--repeats", str(args.repeats),
                   "--assets", str(assets)]  # fmt: skip
    groups = [int(g) for g in args.max_stacked.split(",")] if args.max_stacked else []
    rows = []
    for s in sizes:
        runs = [("sequential", None), ("batched", None)] + [("batched", g) for g in groups if g < s]
        for execution, group in runs:
            cmd = [sys.executable, __file__, *passthrough, "--clients-per-round", str(s), "--execution", execution]
            cmd += ["--max-stacked", str(group)] if group else []
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode or not lines:
                print(f"S={s} {execution} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(lines[-1])
            rows.append(row)
            name = f"{execution}/{group}" if group else execution
            print(f"{args.size} S={s:3d} {name:10s} round {row['round_s']:8.3f} s  peak +{row['peak_growth_in_rounds_MiB']:8.1f} MiB"
                  f"  x{row['round_over_total_batch_steps']} of one fwd/bwd over the total batch", flush=True)  # fmt: skip
    for row in rows:
        seq = next((r for r in rows if r["clients_per_round"] == row["clients_per_round"] and r["execution"] == "sequential"), None)
        if seq is not None:
            row["speedup_vs_sequential"] = round(seq["round_s"] / row["round_s"], 3)
    info = machine()
    print(f"on {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    out = Path(args.out or default_out(info, False, f"lora-{args.size}-{args.device}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "rows": rows}, indent=2))
    print(f"results: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--clients-per-round", type=int, default=1)
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="local steps per client")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--execution", choices=["sequential", "batched"], default="sequential")
    parser.add_argument("--max-stacked", default=None,
                        help="batched: stack at most this many clients at once (BatchedExecutor.max_stacked_clients); "
                             "--sweep: a comma-separated list, one more batched row per value below S")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds run; the first is a warm-up unless it is the only one")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the total-batch reference")
    parser.add_argument("--assets", default=None, help="folder of written data/tokenizer/model, reused if present")
    parser.add_argument("--sweep", default=None, help="comma-separated S values: sequential and batched rows for each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.sweep:
        sweep(args)
    else:
        print(json.dumps(one_round(args)))


if __name__ == "__main__":
    main()
