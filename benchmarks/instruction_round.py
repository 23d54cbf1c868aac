"""Wall time of a federated instruction-tuning round (causal-LM LoRA), sequential vs batched.

Writes the offline Dolly-schema fixture and tiny GPT-2 of the tests (or uses ``--model``/``--data``),
runs ``--rounds`` rounds of FedAvg with S = ``--clients-per-round`` clients for each execution in
its own process, and prints the median time of the rounds after the first (a warm-up):

    PYTHONPATH=$PWD python benchmarks/instruction_round.py --clients-per-round 5
    PYTHONPATH=$PWD python benchmarks/instruction_round.py --model gpt2 --data dolly.jsonl --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(args) -> dict:
    import lightning as L
    import torch

    from datamodules import IID, InstructionDataModule
    from fl_lightning import FederatedModule, LocalTraining, UniformSampling
    from fl_lightning.algorithms import FedAvg
    from models import LoRACausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    data = InstructionDataModule(
        dataset_path=args.data, tokenizer=args.tokenizer, max_length=args.max_length, num_clients=args.num_clients,
        partition=IID(), participation=UniformSampling(args.clients_per_round), seed=0, cache_dir=args.cache,
    )  # fmt: skip
    torch.manual_seed(0)
    module = FederatedModule(
        model=LoRACausalLM(args.model, rank=8, dropout=0.0), algorithm=FedAvg(),
        local=LocalTraining(lr=0.01, steps=args.steps, batch_size=args.batch_size), execution=args.execution,
    )  # fmt: skip
    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    trainer = L.Trainer(
        max_steps=args.rounds, accelerator=args.device, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Clock()],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    timed = times[1:] or times
    fallbacks = dict(getattr(getattr(module.executor, "inner", None), "fallbacks", {}) or {})
    return {"execution": args.execution, "round_s_median": statistics.median(timed), "round_s": timed, "fallbacks": fallbacks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients-per-round", type=int, default=5)
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="the first is a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default=None, help="base causal LM (default: the tests' tiny GPT-2, written here)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--data", default=None, help="Dolly/Alpaca-schema file or hub id (default: the tests' fixture)")
    parser.add_argument("--cache", default=None)
    parser.add_argument("--execution", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.execution:
        print(json.dumps(one(args)))
        return
    if args.model is None or args.data is None:
        from tests.instruction_fixtures import InstructionAssets

        root = Path(tempfile.mkdtemp())
        assets = InstructionAssets(root)
        args.model, args.tokenizer, args.data = str(assets.gpt2), str(assets.tokenizer), str(assets.dolly)
        args.cache = args.cache or str(root / "cache")
    args.tokenizer = args.tokenizer or args.model
    rows = []
    for execution in ("sequential", "batched"):
        argv = [sys.executable, __file__, "--execution", execution]
        for key in ("clients_per_round", "num_clients", "steps", "batch_size", "max_length", "rounds", "threads", "device",
                    "model", "tokenizer", "data", "cache"):  # fmt: skip
            value = getattr(args, key)
            if value is not None:
                argv += [f"--{key.replace('_', '-')}", str(value)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    seq, bat = (r["round_s_median"] for r in rows)
    print(json.dumps({"S": args.clients_per_round, "rows": rows, "batched_speedup": seq / bat}, indent=1))


if __name__ == "__main__":
    main()
