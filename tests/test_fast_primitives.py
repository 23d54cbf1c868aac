"""The fused primitives of the round loop compute exactly what their plain forms do."""

import pytest
import torch

from fl_lightning.core import params as P
from fl_lightning.core.objective import loss_grads
from fl_lightning.reliability.faults import all_finite, first_non_finite, is_finite
from fl_lightning.core.metrics import local_consistency
from fl_lightning.optim import sgd_step

SHAPES = [(16, 8), (16,), (3, 16), (3,)]


def _dicts(count, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [{f"t{j}": torch.randn(s, generator=g) * scale for j, s in enumerate(SHAPES)} for _ in range(count)]


@pytest.mark.parametrize("lr", [0.05, 0.3, 1e-4, torch.tensor(0.01)])
def test_sgd_step_is_bitwise_p_minus_lr_times_d(lr):
    for seed in range(20):
        params, direction = _dicts(2, seed, scale=10.0 ** (seed % 5 - 2))
        fused = sgd_step(params, direction, lr)
        for k, p in params.items():
            assert torch.equal(fused[k], p - lr * direction[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sgd_step_rounds_like_a_python_step_size_in_every_dtype(dtype):
    """On CPU the step size reaches ``_foreach_mul`` as a cached tensor of the tensors' dtype: the same bits."""
    g = torch.Generator().manual_seed(0)
    for lr in [0.05, 1 / 3, 0.0123456789123, 2.5e-4, 0.7] + torch.rand(20, generator=g, dtype=torch.float64).tolist():
        params, direction = ({k: v.to(dtype) for k, v in d.items()} for d in _dicts(2, seed=7, scale=10.0))
        fused = sgd_step(params, direction, lr)
        for k, p in params.items():
            assert torch.equal(fused[k], p - lr * direction[k]) and fused[k].dtype == dtype


def test_loss_grads_equals_autograd_grad():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    expected = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    for a, b in zip(loss_grads(loss, list(model.parameters())), expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stack_limit", [0, P.STACK_LIMIT], ids=["per-tensor", "stacked"])
def test_aggregates_and_metrics_agree_between_stacked_and_per_tensor_paths(monkeypatch, stack_limit):
    monkeypatch.setattr(P, "STACK_LIMIT", stack_limit)
    deltas = _dicts(7, seed=3)
    weights = torch.rand(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    summed = P.weighted_sum(deltas, weights)
    for k in deltas[0]:
        expected = sum(float(w) * d[k].double() for w, d in zip(weights, deltas))
        torch.testing.assert_close(summed[k].double(), expected, rtol=1e-5, atol=1e-6)
    centre = {k: sum(d[k].double() for d in deltas) / 7 for k in deltas[0]}
    naive = sum(float(((d[k].double() - centre[k]) ** 2).sum()) for d in deltas for k in d) / 7
    assert local_consistency(deltas) == pytest.approx(naive, rel=1e-5)
    assert local_consistency(deltas[:1]) == 0.0


@pytest.mark.parametrize("stack_limit", [0, P.STACK_LIMIT], ids=["per-tensor", "stacked"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_uploads_are_found_and_named(monkeypatch, stack_limit, bad):
    monkeypatch.setattr(P, "STACK_LIMIT", stack_limit)
    payloads = [{"delta": d} for d in _dicts(5, seed=4, scale=1e30)]  # huge but finite: no overflow in the check
    payloads[2]["y"] = {"t0": torch.ones(16, 8)}  # a part only some clients upload
    assert all_finite(payloads)
    payloads[3]["delta"]["t2"][1, 5] = bad
    assert not all_finite(payloads)
    assert first_non_finite(payloads[3]) == "delta/t2"
    payloads[3]["delta"]["t2"][1, 5] = 0.0
    payloads[2]["y"]["t0"][0, 0] = bad
    assert not all_finite(payloads)
    assert is_finite(torch.zeros(0)) and is_finite(torch.tensor([1, 2]))


def test_finite_values_whose_sum_overflows_are_finite():
    huge = torch.full((10,), 3e38)
    assert torch.isinf(huge.sum()) and is_finite(huge)
    huge[4] = float("inf")
    assert not is_finite(huge)
