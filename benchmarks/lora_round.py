"""Memory and time of a federated LoRA round (GPT-2 + peft), offline.

Runs one federated round on the tiny test GPT-2 (or a randomly initialised
GPT-2-small-sized model, ``--size small``) with S clients per round, and prints
JSON: peak RSS growth during the round, bytes in the client store, bytes
uploaded, the base model's bytes, and seconds per round / per client step.

    PYTHONPATH=$PWD python benchmarks/lora_round.py --clients-per-round 1
    PYTHONPATH=$PWD python benchmarks/lora_round.py --clients-per-round 10
    PYTHONPATH=$PWD python benchmarks/lora_round.py --size small --clients-per-round 1 --steps 3 --max-length 128

Run each setting in its own process: peak RSS (ru_maxrss) only grows.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--clients-per-round", type=int, default=1)
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="local steps per client")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import lightning as L
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    from datamodules import IID, TextDataModule
    from fl_lightning import FederatedModule, LocalTraining, UniformSampling
    from fl_lightning import params as P
    from fl_lightning.algorithms import Algorithm
    from models import LoRAClassifier
    from tests.text_fixtures import write_tiny_gpt2, write_tokenizer

    class AdamLikeState(Algorithm):
        """Local SGD with two adapter-sized client-state tensors (the footprint of FedIT-AdamGT: v_i, y_i)."""

        def client_state_init(self, x):
            return {"v": P.zeros_like(x), "y": P.zeros_like(x)}

        def client_step(self, params, local, ctx):
            _, grad = ctx.grad(params)
            return P.add(params, grad, -ctx.lr), local

    root = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    files = _long_texts(root, n=args.num_clients * args.batch_size * args.steps, words=args.max_length)
    import pandas as pd

    write_tokenizer(root / "tok", pd.read_parquet(files["train"])["sentence"].tolist()[:200], vocab_size=300)
    if args.size == "tiny":
        write_tiny_gpt2(root / "gpt2", root / "tok")
    else:  # GPT-2 small's shape (124M parameters), random weights: no download
        from transformers import GPT2Config, GPT2LMHeadModel

        GPT2LMHeadModel(GPT2Config(eos_token_id=0, bos_token_id=0)).save_pretrained(str(root / "gpt2"))

    data = TextDataModule(
        task="sst2", tokenizer=str(root / "tok"), data_files=files, cache_dir=str(root / "cache"),
        max_length=args.max_length, num_clients=args.num_clients, partition=IID(),
        participation=UniformSampling(args.clients_per_round),
    )  # fmt: skip
    data.setup()
    torch.manual_seed(0)
    model = LoRAClassifier(str(root / "gpt2"), num_labels=2, rank=8, alpha=16, dropout=0.05)
    module = FederatedModule(
        model=model, algorithm=AdamLikeState(), local=LocalTraining(lr=1e-3, steps=args.steps, batch_size=args.batch_size)
    )
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu", devices=1, default_root_dir=str(root),
    )  # fmt: skip
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    adapter_bytes = P.num_bytes(module.global_params().values())
    rss_before = _peak_mib()
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.fit(module, datamodule=data)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    store = module.store.state_dict()
    batch = next(data.client_batches(0, seed=0, batch_size=args.batch_size, steps=1))
    grad = module.objective.grad_fn(batch, 1e-8)
    grad(module.global_params())  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(3):
        grad(module.global_params())
    step_s, step_cpu_s = (time.perf_counter() - t0) / 3, (time.process_time() - c0) / 3
    client_steps = args.clients_per_round * args.steps
    print(
        json.dumps(
            {
                "size": args.size,
                "clients_per_round": args.clients_per_round,
                "local_steps": args.steps,
                "batch": [args.batch_size, args.max_length],
                "threads": torch.get_num_threads(),
                "base_MiB": round(base_bytes / 2**20, 3),
                "adapter_KiB": round(adapter_bytes / 2**10, 2),
                "store_KiB": round(P.num_bytes(store.values()) / 2**10, 2),
                "clients_in_store": len(module.store),
                "upload_KiB_per_client": round(adapter_bytes / 2**10, 2),
                "peak_rss_before_MiB": round(rss_before, 1),
                "peak_rss_growth_in_round_MiB": round(_peak_mib() - rss_before, 1),
                "round_s": round(seconds, 2),
                "round_cpu_s": round(cpu_seconds, 2),
                "round_s_per_client_step": round(seconds / client_steps, 3),
                "fwd_bwd_s_per_step": round(step_s, 3),
                "fwd_bwd_cpu_s_per_step": round(step_cpu_s, 3),  # process CPU time: robust to a shared machine
                "batch_shape": list(batch["input_ids"].shape),
            }
        )
    )


if __name__ == "__main__":
    main()
