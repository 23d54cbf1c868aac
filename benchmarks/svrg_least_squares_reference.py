"""Bare-PyTorch reference of the least-squares Monte Carlo study (Rostami & Kia, Sec. VI).

The same data (``datamodules.sources.least_squares``), activation probabilities, theta0, steps and
statistics as ``configs/svrg_least_squares_mc.yaml``, but all runs and agents vectorized in float64
without the framework: seconds instead of the framework's minutes per run on a busy 2-core CPU.
Use it to cross-check the framework's Monte Carlo statistics and to get the full 20-run numbers
quickly. Differences from the framework: samples are picked with replacement (Alg. 1 line 13; the
framework draws reshuffled passes) and the random streams differ, so single runs differ but the
statistics should agree within Monte Carlo error.

    python benchmarks/svrg_least_squares_reference.py --runs 20 --out docs/figures/svrg_least_squares_reference
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from datamodules.sources import least_squares
from fl_lightning.experiments.montecarlo import SeriesResult, plot_case, write_tables
from fl_lightning.core.participation import UniformRandomProbabilities


def simulate(kind: str, S: int, M: int, lr: float, rounds: int, runs: int, seed: int, data, p: torch.Tensor):
    """Returns f(theta^k) [runs, rounds + 1], final theta [runs, d], mean active agents [runs]."""
    Q, Y = data  # [N, L, d], [N, L]
    N, L, d = Q.shape
    g = torch.Generator().manual_seed(seed)
    theta = torch.full((runs, d), 0.5, dtype=torch.float64)

    def cost(th):  # (1/N) sum_n 0.5 mean_i (q th - y)^2
        r = torch.einsum("nld,rd->rnl", Q, th) - Y
        return 0.5 * (r**2).mean(dim=(1, 2))

    def sample_grad(w, idx):  # per (run, agent): q_i (q_i . w - y_i) at samples idx [R, N]
        q = Q[torch.arange(N)[None, :], idx]  # [R, N, d]
        y = Y[torch.arange(N)[None, :], idx]
        return q * ((q * w).sum(-1) - y)[..., None]

    history, active_counts = [cost(theta)], []
    for k in range(rounds):
        active = torch.rand(runs, N, generator=g, dtype=torch.float64) < p
        active_counts.append(active.sum(1).double())
        w = theta[:, None, :].expand(runs, N, d).clone()
        if kind == "svrg":
            for _ in range(S):
                snap = w.clone()
                mu = torch.einsum("nld,rnl->rnd", Q, torch.einsum("nld,rnd->rnl", Q, snap) - Y) / L
                for _ in range(M):
                    idx = torch.randint(0, L, (runs, N), generator=g)
                    w = w - lr * (sample_grad(w, idx) - sample_grad(snap, idx) + mu)
        else:
            step = lr / math.sqrt(k + 1)
            for _ in range(S * M):
                idx = torch.randint(0, L, (runs, N), generator=g)
                w = w - step * sample_grad(w, idx)
        theta = theta + ((active / (N * p))[..., None] * (w - theta[:, None, :])).sum(1)
        history.append(cost(theta))
    return torch.stack(history, 1).numpy(), theta.numpy(), torch.stack(active_counts, 1).mean(1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--theta-spread", type=float, default=0.0, help="concept shift between agents (source's theta_spread)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    src = least_squares(num_agents=18, samples_per_agent=50, num_features=5, noise=0.1, feature_shift=0.5, theta_spread=args.theta_spread, seed=0)
    x, y = (t.double() for t in src.train.tensors)
    data = (x.reshape(18, 50, 5), y.reshape(18, 50))
    p = UniformRandomProbabilities(0.2, 0.9, seed=1)(0, 18)
    optimum = float(0.5 * ((x @ torch.linalg.lstsq(x, y[:, None]).solution).squeeze(-1) - y).pow(2).mean())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = {}
    for case, (S, M) in {"(S, M) = (5, 2)": (5, 2), "(S, M) = (10, 5)": (10, 5)}.items():
        cases[case] = []
        for label, kind, lr in (("FedAvg-SVRG", "svrg", 0.1), ("FedAvg 1/sqrt(k)", "sgd", 1.0)):
            start = time.time()
            cost, final, active = simulate(kind, S, M, lr, args.rounds, args.runs, args.seed, data, p)
            cases[case].append(SeriesResult(label, cost, optimum, final, active, time.time() - start))
        plot_case(case, cases[case], out)
    summary = write_tables(cases, out, "python benchmarks/svrg_least_squares_reference.py " + f"--runs {args.runs} --theta-spread {args.theta_spread} --out {args.out}")
    print(summary.read_text())


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
