"""Peak resident memory of SCAFFOLD with many clients: in-memory vs disk-backed client store.

    python benchmarks/store_memory.py --store disk --clients 1000 --rounds 20 --per-round 50

A ~1M-parameter MLP (64-1024-900-10); every client that trains keeps c_i (one model
size). With the in-memory store RSS grows with the clients seen; with DiskClientStore it does not.
Besides the peak RSS (``ru_maxrss``, which counts the page cache of DiskClientStore's mapped tables
that the process touched), it prints the peak of the process's own memory (``RssAnon``, sampled after
every round) and the mapped file pages resident at the end (``RssFile``), which the kernel can reclaim.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from datamodules import IID, FederatedDataModule  # noqa: E402
from fl_lightning import FederatedModule, LocalTraining, UniformSampling  # noqa: E402
from fl_lightning.algorithms import SCAFFOLD  # noqa: E402
from fl_lightning.core.state import DiskClientStore  # noqa: E402
from models import MLP  # noqa: E402


def _rss(field: str) -> float:
    """A ``/proc/self/status`` resident-memory field in MB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class AnonPeak(L.Callback):
    """The largest ``RssAnon`` seen after a round."""

    peak = 0.0

    def on_train_batch_end(self, *args) -> None:
        self.peak = max(self.peak, _rss("RssAnon"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", choices=["memory", "disk"], default="disk")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = MLP(in_features=64, num_classes=10, hidden=[1024, 900])  # 64*1024 + 1024*900 + 900*10 ~ 1.0M
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        store = DiskClientStore(tmp) if args.store == "disk" else None
        module = FederatedModule(model, SCAFFOLD(), LocalTraining(lr=0.05, steps=1, batch_size=4), store=store)
        data = FederatedDataModule(
            "synthetic", dict(num_samples=8 * args.clients, num_features=64, num_classes=10, seed=0),
            num_clients=args.clients, partition=IID(), participation=UniformSampling(args.per_round),
        )  # fmt: skip
        trainer = L.Trainer(
            max_steps=args.rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, accelerator="cpu",
            callbacks=[anon := AnonPeak()],
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        seconds = time.perf_counter() - start
        print(json.dumps(dict(store=args.store, clients=args.clients, clients_with_state=len(module.store),
                              params=params, seconds=round(seconds, 1),
                              peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                              peak_anon_mb=round(anon.peak, 1), file_mb_at_end=round(_rss("RssFile"), 1))))  # fmt: skip


if __name__ == "__main__":
    main()
