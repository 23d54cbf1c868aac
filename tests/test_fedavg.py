import copy

import torch
import torch.nn.functional as F

from datamodules import IID
from fl_lightning import FedAvg, LocalTraining
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


# docs/algorithms.md, E9
def test_fedavg_full_participation_one_full_batch_step_is_gradient_descent(tmp_path):
    """All clients, one full-batch local step, uniform weights == one GD step on the pooled objective."""
    lr = 0.3
    data = tiny_datamodule(num_clients=6, clients_per_round=6, partition=IID())
    module = tiny_module(FedAvg(global_lr=1.0), LocalTraining(lr=lr, steps=1, batch_size=None))
    start = copy.deepcopy(module.model)
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=data)

    # (1/N) sum_i f_i(x) with f_i the mean loss on client i's data; clients are equal-sized under IID.
    assert len(set(data.client_sizes.tolist())) == 1
    x, y = data.source.train.tensors
    pooled = torch.stack([F.cross_entropy(start(x[idx]), y[idx]) for idx in data.client_train]).mean()
    pooled.backward()
    for (name, p0), p1 in zip(start.named_parameters(), module.model.parameters()):
        torch.testing.assert_close(p1.detach(), p0.detach() - lr * p0.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_fedavg_global_lr_scales_the_averaged_update(tmp_path):
    """x_new - x = eta_g * mean(delta): two runs differing only in eta_g differ by exactly that factor."""
    moved = {}
    for eta in (1.0, 0.5):
        module = tiny_module(FedAvg(global_lr=eta), LocalTraining(lr=0.1, steps=2, batch_size=None))
        before = [p.detach().clone() for p in module.model.parameters()]
        tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=tiny_datamodule(clients_per_round=6))
        moved[eta] = [p.detach() - b for p, b in zip(module.model.parameters(), before)]
    for full, half in zip(moved[1.0], moved[0.5]):
        torch.testing.assert_close(half, 0.5 * full)


def test_sample_weighting_weights_by_client_size(tmp_path):
    """With one full-batch step, sample-count weighting == GD on the pooled (per-sample) objective."""
    from datamodules import Dirichlet
    from fl_lightning import UniformSampling

    lr = 0.2
    data = tiny_datamodule(num_clients=5, partition=Dirichlet(0.3, min_size=5))
    data.participation = UniformSampling(5, weighting="samples")
    module = tiny_module(FedAvg(), LocalTraining(lr=lr, steps=1, batch_size=None))
    start = copy.deepcopy(module.model)
    tiny_trainer(tmp_path, rounds=1).fit(module, datamodule=data)
    assert len(set(data.client_sizes.tolist())) > 1, "test needs unequal clients"
    x, y = data.source.train.tensors
    F.cross_entropy(start(x), y).backward()
    for p0, p1 in zip(start.parameters(), module.model.parameters()):
        torch.testing.assert_close(p1.detach(), p0.detach() - lr * p0.grad, rtol=1e-5, atol=1e-6)


def test_local_lr_decays_per_round():
    local = LocalTraining(lr=0.1, lr_decay=0.5)
    assert [local.lr_at(t) for t in range(3)] == [0.1, 0.05, 0.025]


def test_epochs_mode_takes_ceil_n_over_b_steps_per_epoch():
    data = tiny_datamodule(num_clients=4, clients_per_round=2)
    data.setup()
    n = int(data.client_sizes[0])
    batches = list(data.client_batches(0, seed=1, batch_size=7, epochs=2))
    assert len(batches) == data.num_local_steps(0, 7, None, 2) == 2 * -(-n // 7)
    seen = torch.cat([b[1] for b in batches[: len(batches) // 2]])
    assert len(seen) == n  # one epoch visits every sample once
