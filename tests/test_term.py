"""Client-level TERM (fl_lightning/algorithms/term.py, docs/algorithms.md (30.4)-(30.5)) against an independent
float64 reference, sequential and batched; t = 0 is FedAvg bitwise."""

from __future__ import annotations

import pytest
import torch

from fl_lightning import algorithms
from tests.test_qffl import LR, ROUNDS, STEPS, _fit


def _reference(model, data, x, tilt):
    """Each round: every client's K full-batch GD steps from x; x <- sum_k p_k e^{t F_k(x)} x_k / sum_k p_k e^{t F_k(x)}."""
    sizes = data.client_sizes.double()
    weights = sizes / sizes.sum()

    def loss(params, batch):
        inputs, target = batch
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (inputs,)), target)

    for _ in range(ROUNDS):
        numerator = {k: torch.zeros_like(v) for k, v in x.items()}
        denominator = torch.zeros((), dtype=torch.float64)
        for cid in range(data.num_clients):
            batch = data.client_full_batch(cid)
            w = {k: v.clone() for k, v in x.items()}
            for _ in range(STEPS):
                grads = torch.autograd.grad(loss({k: v.requires_grad_() for k, v in w.items()}, batch), list(w.values()))
                w = {k: (v - LR * g).detach() for (k, v), g in zip(w.items(), grads)}
            tilted = weights[cid] * torch.exp(tilt * loss(x, batch).detach())
            for k in x:
                numerator[k] += tilted * w[k]
            denominator += tilted
        x = {k: numerator[k] / denominator for k in x}
    return x


@pytest.mark.parametrize("tilt", [-1.0, 1.0, 5.0])
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_term_matches_the_reference_in_float64(tmp_path, tilt, execution):
    module, data, initial = _fit(tmp_path, algorithms.TERM(tilt=tilt), execution)
    if execution == "batched":
        assert not module.executor.fallbacks
    expected = _reference(module.model, data, initial, tilt)
    for name, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-12, atol=1e-12)


def test_tilt_zero_is_fedavg_bitwise(tmp_path):
    term, _, _ = _fit(tmp_path / "t", algorithms.TERM(tilt=0))
    fedavg, _, _ = _fit(tmp_path / "f", algorithms.FedAvg())
    for a, b in zip(term.model.parameters(), fedavg.model.parameters()):
        assert torch.equal(a, b)


def test_a_non_finite_tilt_is_refused():
    with pytest.raises(ValueError, match=r"TERM tilt must be a finite number, got inf"):
        algorithms.TERM(tilt=float("inf"))
