"""A 2-node DDP run on one machine, checked against one process (docs/cluster.md).

Runs ``fl-lightning fit`` three ways on the same tiny config (configs/quickstart.yaml, 2 rounds) and prints
the largest difference of each multi-process global model from the one-process model:

1. one process;
2. ``torchrun --nnodes 2 --nproc-per-node 1`` twice (node ranks 0 and 1), static rendezvous on 127.0.0.1;
3. Lightning's own launch with ``--trainer.num_nodes 2`` and MASTER_ADDR / MASTER_PORT / NODE_RANK set by
   hand, as a scheduler that is not SLURM would set them.

    python scripts/two_nodes_check.py [--out runs/two_nodes_check] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CKPT = "runs/quickstart/version_0/checkpoints/last.ckpt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_args(rounds: int) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", str(rounds),
            "--trainer.val_check_interval", str(rounds), "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", str(rounds)]  # fmt: skip


def run_nodes(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(c, env={**os.environ, **e}, cwd=cwd) for c, e in zip(commands, envs)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"a node exited with {codes} in {cwd}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/two_nodes_check")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    fit = fit_args(args.rounds)
    cli = [sys.executable, "-m", "fl_lightning.commands.cli", *fit]
    ddp = ["--trainer.strategy", "ddp", "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2", "--trainer.devices", "1"]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    runs = {}
    for name in ("one_process", "torchrun_2_nodes", "lightning_2_nodes"):
        (out / name).mkdir(parents=True)
    runs["one_process"] = run_nodes([cli], [{}], out / "one_process")
    port = str(free_port())
    runs["torchrun_2_nodes"] = run_nodes(
        [[torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr", "127.0.0.1",
          "--master-port", port, "-m", "fl_lightning.commands.cli", *fit[0:], *ddp] for r in (0, 1)],
        [{}, {}], out / "torchrun_2_nodes",
    )  # fmt: skip
    port = str(free_port())
    runs["lightning_2_nodes"] = run_nodes(
        [[*cli, *ddp]] * 2, [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(r)} for r in (0, 1)],
        out / "lightning_2_nodes",
    )
    reference = torch.load(out / "one_process" / CKPT, weights_only=True)
    print(f"\none process: {args.rounds} rounds in {runs['one_process']:.1f} s (wall, with start-up)")
    for name in ("torchrun_2_nodes", "lightning_2_nodes"):
        other = torch.load(out / name / CKPT, weights_only=True)
        assert other["global_step"] == reference["global_step"] == args.rounds
        diff = max(float((other["state_dict"][k] - v).abs().max()) for k, v in reference["state_dict"].items())
        scale = max(float(v.abs().max()) for v in reference["state_dict"].values())
        print(f"{name}: {args.rounds} rounds in {runs[name]:.1f} s; largest parameter difference from one process "
              f"{diff:.3g} (largest parameter {scale:.3g})")  # fmt: skip


if __name__ == "__main__":
    main()
