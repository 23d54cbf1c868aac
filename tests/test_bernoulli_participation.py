"""Independent (Bernoulli) client activation: unbiased 1/(N p) aggregation, validation, empty rounds."""

import math

import pytest
import torch

from datamodules import IID, FederatedDataModule
from fl_lightning import FedAvg, LocalTraining
from fl_lightning.algorithms import RoundInfo
from fl_lightning.core.participation import (
    BernoulliParticipation,
    FixedProbabilities,
    Participation,
    PeriodicProbabilities,
    UniformRandomProbabilities,
    UniformSampling,
)
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

P_VEC = [0.15, 0.3, 0.5, 0.7, 0.9, 1.0]


def _aggregate_draws(participation: Participation, deltas: torch.Tensor, draws: int) -> torch.Tensor:
    """sum_i w_i delta_i (the update of FedAvg's aggregate, -pseudo_grad) for ``draws`` independent rounds.

    Computed as a dense [draws, N] weight matrix times the deltas; the first rounds also go through
    ``FedAvg.aggregate`` to check that it is the same thing.
    """
    n = len(deltas)
    sizes = torch.full((n,), 10)
    generator = torch.Generator().manual_seed(1234)
    dense = torch.zeros(draws, n, dtype=torch.float64)
    for k in range(draws):
        clients, weights = participation.sample(k, sizes, generator)
        dense[k, clients] = weights
        if k < 20 and len(clients):
            info = RoundInfo(round=k, local_lr=0.1, num_clients=n)
            uploads = [{"delta": {"w": deltas[int(c)]}} for c in clients]
            pseudo_grad, _ = FedAvg().aggregate({"w": torch.zeros_like(deltas[0])}, uploads, weights, {}, info, [1] * len(uploads))
            torch.testing.assert_close(-pseudo_grad["w"], dense[k] @ deltas)
    return dense @ deltas


# docs/algorithms.md, E10
def test_monte_carlo_mean_of_inverse_probability_aggregate_is_the_full_participation_update():
    """E[sum_{n in A} d_n / (N p_n)] = (1/N) sum_n d_n (Rostami & Kia, Alg. 1 line 20).

    Tolerance from the variance: per coordinate the aggregate is a sum of independent terms
    1_n d_n / (N p_n) with variance d_n^2 (1 - p_n) / (N^2 p_n), so the mean of R draws has
    standard error se = sqrt(sum_n d_n^2 (1 - p_n) / p_n / R) / N. We allow 4.5 se per coordinate
    (two-sided false-alarm probability 7e-6 each, < 1e-4 over the 8 coordinates; the seed is fixed
    anyway). The biased plain mean of the active clients must miss by far more than that.
    """
    torch.manual_seed(0)
    n, draws = len(P_VEC), 2000
    d = torch.randn(n, 8, dtype=torch.float64) + 3.0 * torch.arange(n, dtype=torch.float64)[:, None]  # heterogeneous
    full = d.mean(0)
    p = torch.tensor(P_VEC, dtype=torch.float64)
    se = ((d**2 * ((1 - p) / p)[:, None]).sum(0) / draws).sqrt() / n

    unbiased = _aggregate_draws(BernoulliParticipation(P_VEC), d, draws).mean(0)
    assert ((unbiased - full).abs() <= 4.5 * se).all(), ((unbiased - full) / se)

    biased = _aggregate_draws(BernoulliParticipation(P_VEC, weighting="active_mean"), d, draws).mean(0)
    assert ((biased - full).abs() > 4.5 * se).any(), "negative control: plain averaging of the active set is biased"


def test_weights_are_one_over_n_p_and_activation_frequencies_match_p():
    part = BernoulliParticipation(P_VEC)
    counts = torch.zeros(len(P_VEC))
    for k in range(500):
        plan = part.plan(k, torch.full((6,), 5), seed=3)
        torch.testing.assert_close(plan.weights, 1.0 / (6 * torch.tensor(P_VEC, dtype=torch.float64)[plan.clients]))
        counts[plan.clients] += 1
    freq = counts / 500
    # binomial standard error sqrt(p(1-p)/500) <= 0.023; 4.5 se
    assert ((freq - torch.tensor(P_VEC)).abs() < 0.1).all(), freq
    assert counts[-1] == 500  # p = 1: always active


def test_probability_sources():
    fixed = FixedProbabilities(0.4)
    assert torch.equal(fixed(3, 5), torch.full((5,), 0.4, dtype=torch.float64))
    drawn = UniformRandomProbabilities(0.2, 0.6, seed=7)
    a = drawn(0, 18)
    assert torch.equal(a, drawn(50, 18)) and torch.equal(a, UniformRandomProbabilities(0.2, 0.6, seed=7)(0, 18))
    assert (a >= 0.2).all() and (a <= 0.6).all() and a.std() > 0.05
    assert not torch.equal(a, UniformRandomProbabilities(0.2, 0.6, seed=8)(0, 18))
    periodic = PeriodicProbabilities(0.1, 0.9, period=10, seed=0)
    series = torch.stack([periodic(k, 4) for k in range(10)])
    assert (series >= 0.1).all() and (series <= 0.9).all()
    assert (series.max(0).values - series.min(0).values > 0.5).all(), "each client's p varies over a period"
    torch.testing.assert_close(periodic(3, 4), periodic(13, 4))  # periodic in k
    # time-varying p reaches the weights of the round
    part = BernoulliParticipation(periodic)
    clients, weights = part.sample(3, torch.full((4,), 5), torch.Generator().manual_seed(0))
    torch.testing.assert_close(weights, 1 / (4 * periodic(3, 4)[clients]))


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: BernoulliParticipation([0.5, 0.0]), r"client 1 is 0.0; each must be in \(0, 1\]"),
        (lambda: BernoulliParticipation([1.5]), r"client 0 is 1.5; each must be in \(0, 1\]"),
        (lambda: BernoulliParticipation(-0.1), r"each must be in \(0, 1\]"),
        (lambda: BernoulliParticipation([0.5, math.nan]), r"client 1 is nan"),
        (lambda: BernoulliParticipation([0.5, 0.5], weighting="nope"), "weighting must be"),
        (lambda: UniformRandomProbabilities(0.0, 0.5), r"0 < low <= high <= 1"),
        (lambda: UniformRandomProbabilities(0.6, 0.5), r"0 < low <= high <= 1"),
        (lambda: PeriodicProbabilities(0.1, 1.2), r"0 < low <= high <= 1"),
        (lambda: PeriodicProbabilities(period=0), "period must be > 0"),
        (lambda: tiny_datamodule(num_clients=4).__class__(num_clients=4, participation=BernoulliParticipation([0.5] * 3)), "has 3 activation probabilities but num_clients=4"),
    ],
)
def test_bad_probabilities_are_rejected_with_their_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


class _FirstRoundOnly(Participation):
    """All clients in round 0, nobody afterwards (a Bernoulli draw can do this; here it is certain)."""

    def validate(self, num_clients):
        pass

    def sample(self, round_idx, client_sizes, generator):
        n = len(client_sizes) if round_idx == 0 else 0
        return torch.arange(n), torch.full((n,), 1.0 / max(n, 1), dtype=torch.float64)


class _FedAvgMomentum(FedAvg):
    def server_optimizer(self, params):
        return torch.optim.SGD(params, lr=1.0, momentum=0.9)


def test_empty_rounds_leave_model_and_server_optimizer_unchanged_and_are_counted(tmp_path):
    """Rounds without clients: x and the momentum buffer stay bitwise as they are (a zero grad
    would still move x through momentum), and Lightning still counts every round."""
    import lightning as L

    class AfterFirstRound(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 0:
                opt = module.optimizers().optimizer
                self.params = [p.detach().clone() for p in module.model.parameters()]
                self.buffers = [opt.state[p]["momentum_buffer"].clone() for p in module.model.parameters()]
                self.store = module.store.state_dict()

    data = tiny_datamodule(num_clients=4, partition=IID())
    data.participation = _FirstRoundOnly()
    module = tiny_module(_FedAvgMomentum(), LocalTraining(lr=0.1, steps=2, batch_size=8))
    start = [p.detach().clone() for p in module.model.parameters()]
    snap = AfterFirstRound()
    trainer = tiny_trainer(tmp_path, rounds=4, callbacks=[snap])
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4
    assert trainer.logged_metrics["train/clients"] == 0
    assert not torch.equal(snap.params[0], start[0]), "round 0 trained"
    opt = module.optimizers().optimizer
    for p, p1, b1 in zip(module.model.parameters(), snap.params, snap.buffers):
        assert torch.equal(p.detach(), p1)
        assert torch.equal(opt.state[p]["momentum_buffer"], b1)
    store = module.store.state_dict()
    assert store.keys() == snap.store.keys() and all(torch.equal(store[k], snap.store[k]) for k in store)


# docs/algorithms.md, E10
def test_all_probabilities_one_equals_full_participation(tmp_path):
    """p = 1 for everyone: weights 1/N, bitwise the same run as sampling all N clients uniformly."""
    params = {}
    for name, part in (("bernoulli", BernoulliParticipation(1.0)), ("uniform", UniformSampling(5))):
        data = tiny_datamodule(num_clients=5, partition=IID())
        data.participation = part
        module = tiny_module(FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8))
        tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=data)
        params[name] = [p.detach() for p in module.model.parameters()]
    for a, b in zip(params["bernoulli"], params["uniform"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
