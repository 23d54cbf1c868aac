"""Throughput of asynchronous execution: client tasks per wall second of FedBuff and FedAsync against
synchronous FedAvg rounds of the same work (the same number of client tasks of the same size).

    python benchmarks/async_throughput.py [--tasks 200] [--execution sequential batched]

Digits (20 clients, Dirichlet 0.3), the quickstart's SmallCNN, 5 local steps of batch 20, the clock of
configs/compare_time_digits.yaml; no evaluation. Sync: tasks/5 rounds of 5 clients; FedBuff B=5, C=10:
tasks/5 server updates; FedAsync C=10: tasks updates. Prints one JSON line per run: tasks per second,
server updates per second, simulated seconds, and the machine (one torch thread, as the CLI for this model).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import machine  # noqa: E402


def run(kind: str, tasks: int, execution: str) -> dict:
    import lightning as L
    import torch

    from datamodules import Dirichlet, FederatedDataModule
    from fl_lightning import FederatedModule, LocalTraining, UniformSampling
    from fl_lightning.clock import SimClock
    from fl_lightning.clock.asynchronous import AsyncAggregation
    from fl_lightning.models import SmallCNN

    asynchronous = {"sync": None, "fedbuff": AsyncAggregation(buffer_size=5, concurrency=10),
                    "fedasync": AsyncAggregation(mode="fedasync", concurrency=10)}[kind]  # fmt: skip
    steps = tasks if kind == "fedasync" else tasks // 5
    torch.manual_seed(0)
    module = FederatedModule(
        SmallCNN(in_channels=1, num_classes=10, image_size=8), local=LocalTraining(lr=0.05, steps=5, batch_size=20), execution=execution,
        clock=SimClock(speed_sigma=1.0, bandwidth_sigma=0.5), asynchronous=asynchronous,
    )  # fmt: skip
    data = FederatedDataModule(dataset="digits", num_clients=20, partition=Dirichlet(0.3, min_size=10), participation=UniformSampling(5))
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu", devices=1)  # fmt: skip
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    return {"run": kind, "execution": execution, "client_tasks": tasks, "server_updates": steps, "wall_s": round(seconds, 2),
            "tasks_per_s": round(tasks / seconds, 1), "updates_per_s": round(steps / seconds, 1), "sim_s": round(module.sim_time, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--execution", nargs="+", default=["sequential", "batched"])
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # as the CLI's --threads auto for this small model (fl_lightning/run/threads.py)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for execution in args.execution:
        for kind in ("sync", "fedbuff", "fedasync"):
            print(json.dumps({**run(kind, args.tasks, execution), "machine": machine()}), flush=True)


if __name__ == "__main__":
    main()
