"""Throughput and memory of federated execution against a bare PyTorch FedAvg loop.

    python benchmarks/run.py --out results.json [--quick]

Each (workload, execution, clients_per_round) row runs in a fresh subprocess so
``peak_rss_mb`` is that configuration's own peak. ``ratio_vs_bare`` divides the
row's client-steps/s by the bare loop's on the same workload and S, measured in
the same invocation. Rows: ``{workload, execution, clients_per_round,
client_steps_per_s, peak_rss_mb, ratio_vs_bare}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_CLIENTS, LOCAL_STEPS, BATCH, LR = 100, 4, 16, 0.05

WORKLOADS = {
    # name: (dataset args, model builder spec)
    "mlp": dict(dataset="synthetic", dataset_args=dict(num_samples=8000, num_features=32, num_classes=10, seed=0)),
    "cnn": dict(dataset="digits", dataset_args={}),
}


def _build_model(workload: str):
    import torch

    from models import MLP, SmallCNN

    torch.manual_seed(0)
    return MLP(32, 10, hidden=[64]) if workload == "mlp" else SmallCNN()


def _datamodule(workload: str, clients_per_round: int):
    from datamodules import IID, FederatedDataModule
    from fl_lightning import UniformSampling

    spec = WORKLOADS[workload]
    data = FederatedDataModule(
        num_clients=NUM_CLIENTS if workload == "mlp" else 50,
        partition=IID(),
        participation=UniformSampling(clients_per_round),
        **spec,
    )
    data.setup()
    return data


def bare_loop(workload: str, clients_per_round: int, rounds: int) -> float:
    """Hand-written sequential FedAvg: copy x in, K SGD steps, accumulate deltas, average. Returns seconds."""
    import torch
    import torch.nn.functional as F

    data = _datamodule(workload, clients_per_round)
    x, y = data.source.train.tensors
    model = _build_model(workload)
    params = list(model.parameters())
    global_params = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(rounds):
        clients = torch.randperm(data.num_clients, generator=generator)[:clients_per_round]
        total = [torch.zeros_like(g) for g in global_params]
        for c in clients.tolist():
            idx_all = data.client_train[c]
            with torch.no_grad():
                for p, g in zip(params, global_params):
                    p.copy_(g)
            for _ in range(LOCAL_STEPS):
                idx = idx_all[torch.randint(len(idx_all), (BATCH,), generator=generator)]
                loss = F.cross_entropy(model(x[idx]), y[idx])
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(g, alpha=LR)
            with torch.no_grad():
                for t, p, g in zip(total, params, global_params):
                    t.add_(p - g)
        with torch.no_grad():
            for g, t in zip(global_params, total):
                g.add_(t, alpha=1.0 / clients_per_round)
    return time.perf_counter() - start


def framework(workload: str, clients_per_round: int, rounds: int, execution: str) -> float:
    """FedAvg through FederatedModule + Trainer.fit; times the round loop only (a callback).

    ``ddp2``: sequential execution with the round's clients split over 2 DDP processes (gloo).
    """
    import lightning as L

    from fl_lightning import FedAvg, FederatedModule, LocalTraining

    class Timer(L.Callback):
        def on_train_start(self, trainer, module):
            self.start = time.perf_counter()

        def on_train_end(self, trainer, module):
            self.seconds = time.perf_counter() - self.start

    timer = Timer()
    kwargs = {"execution": "batched"} if execution == "batched" else {}
    distributed = dict(devices=2, strategy="ddp") if execution == "ddp2" else {}
    module = FederatedModule(
        _build_model(workload), FedAvg(), LocalTraining(lr=LR, steps=LOCAL_STEPS, batch_size=BATCH), **kwargs
    )
    trainer = L.Trainer(
        max_steps=rounds, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer], accelerator="cpu", **distributed,
    )  # fmt: skip
    trainer.fit(module, datamodule=_datamodule(workload, clients_per_round))
    if trainer.global_rank != 0:
        raise SystemExit(0)  # only rank 0 reports
    return timer.seconds


def single(workload: str, execution: str, clients_per_round: int, rounds: int) -> dict:
    import torch

    torch.set_num_threads(1)
    if execution == "bare":
        seconds = bare_loop(workload, clients_per_round, rounds)
    else:
        seconds = framework(workload, clients_per_round, rounds, execution)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps = rounds * clients_per_round * LOCAL_STEPS
    return dict(
        workload=workload, execution=execution, clients_per_round=clients_per_round,
        client_steps_per_s=steps / seconds, peak_rss_mb=round(peak_mb, 1),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results.json")
    parser.add_argument("--quick", action="store_true", help="fewer rounds: the whole run in under 2 minutes")
    parser.add_argument("--executions", default="bare,sequential,batched,ddp2")
    parser.add_argument("--_single", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._single:
        workload, execution, s, rounds = args._single
        print(json.dumps(single(workload, execution, int(s), int(rounds))))
        return

    rounds = 5 if args.quick else 20
    plan = [("mlp", 10), ("mlp", 50), ("cnn", 20)]
    rows = []
    for workload, s in plan:
        bare_rate = None
        for execution in args.executions.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--_single", workload, execution, str(s), str(rounds)],
                capture_output=True, text=True, cwd=ROOT,
            )  # fmt: skip
            if out.returncode != 0:
                print(f"{workload}/{execution}/S={s} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if execution == "bare":
                bare_rate = row["client_steps_per_s"]
            row["ratio_vs_bare"] = round(row["client_steps_per_s"] / bare_rate, 3) if bare_rate else None
            row["client_steps_per_s"] = round(row["client_steps_per_s"], 1)
            rows.append(row)
            print(f"{workload:5s} {execution:10s} S={s:3d} {row['client_steps_per_s']:10.1f} steps/s "
                  f"{row['peak_rss_mb']:8.1f} MB  x{row['ratio_vs_bare']}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
