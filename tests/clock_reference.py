"""An independent float64 numpy event simulation of the clock, FedBuff, FedAsync and synchronous FedAvg
on least squares (docs/algorithms.md, 27), and the tiny problem the tests compare it on."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from datamodules import FederatedDataModule
from datamodules.partition import Partitioner
from datamodules.sources import DataSource
from fl_lightning import UniformSampling
from fl_lightning.core.participation import derive_seed

N, n, d = 8, 10, 3
K, LR, STEP_COST, BANDWIDTH = 3, 0.1, 0.1, 400.0
DEVICE_STREAM, DISPATCH_STREAM = 0xC10C, 0xA5C1


class Blocks(Partitioner):
    def __call__(self, labels, num_clients, seed):
        return [torch.arange(i * n, (i + 1) * n) for i in range(num_clients)]


class LeastSquaresData(FederatedDataModule):
    def __init__(self, x, y, clients_per_round=N):
        super().__init__(num_clients=N, partition=Blocks(), participation=UniformSampling(clients_per_round))
        self.xy = (x, y)

    def build_source(self):
        data = TensorDataset(*self.xy)
        return DataSource(data, data, self.xy[1], num_classes=1)


def problem():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N * n, d, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2.0, N * n, dtype=torch.float64)[:, None]
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + torch.randn(N * n, generator=g, dtype=torch.float64)
    return x, y


def devices(seed, speed_sigma, bandwidth_sigma):
    """s_i = exp(sigma_s z_i), b_i = B exp(sigma_b z'_i) from the clock seed's stream (27.1)."""
    z = np.random.default_rng(derive_seed(seed, DEVICE_STREAM)).standard_normal((2, N))
    return np.exp(speed_sigma * z[0]), BANDWIDTH * np.exp(bandwidth_sigma * z[1])


def local_gd(theta, client, x, y):
    """K full-batch gradient steps on 0.5 mean((a w + b - y)^2) from theta = (w, b)."""
    a, t = x[client * n : (client + 1) * n], y[client * n : (client + 1) * n]
    theta = theta.copy()
    for _ in range(K):
        r = a @ theta[:d] + theta[d] - t
        theta = theta - LR * np.concatenate([a.T @ r / n, [r.mean()]])
    return theta


def staleness(tau, exponent=0.5):
    return (1.0 + tau) ** -exponent


def simulate_async(theta0, x, y, speed, bandwidth, seed, mode, concurrency, buffer_size, updates, alpha=0.6, global_lr=1.0):
    """FedBuff/FedAsync by events: returns [(theta, time)] after each server update."""
    nbytes = 2 * (d + 1) * 8  # the model down, the delta up, float64
    arrivals = 1 if mode == "fedasync" else buffer_size
    theta, now, in_flight, versions, dispatched, out = theta0.copy(), 0.0, [], {}, 0, []

    def dispatch(version, waiting):
        nonlocal dispatched
        busy = {e[3] for e in in_flight} | {e[3] for e in waiting}
        idle = [c for c in range(N) if c not in busy]
        rng = np.random.default_rng(derive_seed(seed, dispatched, DISPATCH_STREAM))
        c = idle[int(rng.integers(len(idle)))]
        finish = now + K * STEP_COST / speed[c] + nbytes / bandwidth[c]
        in_flight.append((finish, float(rng.random()), dispatched, c, version))
        versions.setdefault(version, theta.copy())
        dispatched += 1

    for t in range(updates):
        while len(in_flight) < concurrency:
            dispatch(t, [])
        buffer = []
        while len(buffer) < arrivals:
            in_flight.sort()
            event = in_flight.pop(0)
            now = max(now, event[0])
            buffer.append(event)
            if len(buffer) < arrivals:
                dispatch(t, buffer)
        step = np.zeros(d + 1)
        for _, _, _, c, v in buffer:
            trained = local_gd(versions[v], c, x, y)
            if mode == "fedbuff":
                step += staleness(t - v) / buffer_size * (trained - versions[v])
            else:
                step += alpha * staleness(t - v) * (trained - theta)
        theta = theta + global_lr * step
        out.append((theta.copy(), now))
    return out


def simulate_sync(theta0, x, y, speed, bandwidth, rounds):
    """Synchronous FedAvg with every client: the buffer is the cohort, no staleness; each round lasts its slowest task."""
    nbytes = 2 * (d + 1) * 8
    theta, now, out = theta0.copy(), 0.0, []
    for _ in range(rounds):
        theta = theta + sum(local_gd(theta, c, x, y) - theta for c in range(N)) / N
        now += max(K * STEP_COST / speed[c] + nbytes / bandwidth[c] for c in range(N))
        out.append((theta.copy(), now))
    return out
