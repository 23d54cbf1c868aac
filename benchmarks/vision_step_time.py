"""Time of one local SGD step (forward, backward, update) of the vision models.

    PYTHONPATH=$PWD python benchmarks/vision_step_time.py [--batch 50] [--steps 10] [--device cpu]

Prints milliseconds per step (median of ``--steps`` after 2 warm-up steps), wall
and process CPU time; on a shared, overloaded CPU the CPU time divided by the
thread count estimates the wall time the machine would give alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from models import FedAvgCNN, ResNet18, ResNet18x64


def step_time(
    model: torch.nn.Module, shape: tuple[int, ...], classes: int, batch: int, steps: int, device: str
) -> tuple[float, float]:
    """Median wall ms per step and median process CPU ms per step (CPU time shows the cost on a shared machine)."""
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    times, cpu = [], []
    for i in range(steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.process_time()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    return statistics.median(times) * 1000, statistics.median(cpu) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="resnet18_gn,resnet18_bn,resnet18x64_gn,fedavg_cnn")
    args = parser.parse_args()
    print(f"device={args.device} threads={torch.get_num_threads()} batch={args.batch}")
    cases = {
        "resnet18_gn": (lambda: ResNet18(10), (3, 32, 32), 10),
        "resnet18_bn": (lambda: ResNet18(10, norm="batch"), (3, 32, 32), 10),
        "resnet18x64_gn": (lambda: ResNet18x64(200), (3, 64, 64), 200),
        "fedavg_cnn": (lambda: FedAvgCNN(1, 10, 28), (1, 28, 28), 10),
    }
    for name in args.models.split(","):
        build, shape, classes = cases[name]
        ms, cpu_ms = step_time(build(), shape, classes, args.batch, args.steps, args.device)
        print(f"{name}: {ms:.1f} ms/step wall, {cpu_ms:.1f} ms/step process CPU time")


if __name__ == "__main__":
    main()
