"""Client-level TERM (fl_lightning/algorithms/term.py, docs/algorithms.md (30.4)-(30.5)) against an independent
float64 reference, sequential and batched; t = 0 is FedAvg bitwise."""

from __future__ import annotations

import pytest
import torch

from fl_lightning import algorithms
from tests.test_qffl import (
    assert_fedavg_bitwise,
    assert_matches_reference,
    local_rounds,
)


def _reference(model, data, x, tilt):
    """Each round: x <- sum_k w_k e^{t F_k(x)} w_bar_k / sum_k w_k e^{t F_k(x)}."""

    def step(x, clients):
        tilted = [(weight * torch.exp(tilt * f), w) for weight, w, f in clients]
        total = sum(t for t, _ in tilted)
        return {k: sum(t * w[k] for t, w in tilted) / total for k in x}

    return local_rounds(model, data, x, step)


@pytest.mark.parametrize("tilt", [-1.0, 1.0, 5.0])
@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_term_matches_the_reference_in_float64(tmp_path, tilt, execution):
    assert_matches_reference(tmp_path, algorithms.TERM(tilt=tilt), execution, lambda m, d, x: _reference(m, d, x, tilt))


def test_tilt_zero_is_fedavg_bitwise(tmp_path):
    assert_fedavg_bitwise(tmp_path, algorithms.TERM(tilt=0))


def test_a_non_finite_tilt_is_refused():
    with pytest.raises(ValueError, match=r"TERM tilt must be a finite number, got inf"):
        algorithms.TERM(tilt=float("inf"))
