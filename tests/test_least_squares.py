"""Heterogeneous least squares, full participation, full-batch local steps (float64).

SCAFFOLD and FedDyn converge to the global optimum; FedAvg's fixed point with K > 1
local steps is biased when the clients' Hessians differ.
"""

import pytest
import torch
from torch.utils.data import TensorDataset

from datamodules import FederatedDataModule
from datamodules.partition import Partitioner
from datamodules.sources import DataSource
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedDyn
from models import LinearRegression
from tests.conftest import tiny_trainer

N, n, d = 4, 20, 3
ROUNDS = 50


class Blocks(Partitioner):
    """Client i gets samples [i*n, (i+1)*n): the heterogeneity is in how the data was generated."""

    def __call__(self, labels, num_clients, seed):
        size = len(labels) // num_clients
        return [torch.arange(i * size, (i + 1) * size) for i in range(num_clients)]


class LeastSquaresData(FederatedDataModule):
    def __init__(self, x, y):
        super().__init__(num_clients=N, partition=Blocks(), participation=UniformSampling(N))
        self.xy = (x, y)

    def build_source(self):
        data = TensorDataset(*self.xy)
        return DataSource(data, data, self.xy[1], num_classes=1)


def _problem():
    g = torch.Generator().manual_seed(0)
    xs, ys = [], []
    for i in range(N):
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * (0.6 + 0.2 * i) + 0.2 * i  # different Hessians
        w = torch.randn(d, generator=g, dtype=torch.float64) * 2
        xs.append(x)
        ys.append(x @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64))
    x, y = torch.cat(xs), torch.cat(ys)
    # equal client sizes: the uniform mean of client objectives is the pooled least-squares objective
    a = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    optimum = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
    return x, y, optimum


@pytest.fixture(scope="module")
def problem():
    return _problem()


def _distance(tmp_path, algorithm, problem, rounds):
    x, y, optimum = problem
    torch.manual_seed(0)
    module = FederatedModule(LinearRegression(d).double(), algorithm, LocalTraining(lr=0.2, steps=5, batch_size=None))
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=LeastSquaresData(x, y))
    final = torch.cat([module.model.linear.weight.detach().flatten(), module.model.linear.bias.detach()])
    return float((final - optimum).norm())


# docs/algorithms.md, E14
@pytest.mark.parametrize("algorithm", [SCAFFOLD(), FedDyn(alpha=1.5)], ids=["SCAFFOLD", "FedDyn"])
def test_drift_corrected_algorithms_reach_the_global_optimum(tmp_path, problem, algorithm):
    assert _distance(tmp_path, algorithm, problem, rounds=ROUNDS) < 1e-6


# docs/algorithms.md, E14
def test_fedavg_stays_measurably_away(tmp_path, problem):
    assert _distance(tmp_path, FedAvg(), problem, rounds=ROUNDS) > 1e-3

