"""Property-based checks of setting validation: every invalid combination is rejected with a
message naming the setting, every valid one builds."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules import Dirichlet
from fl_lightning import LocalTraining, UniformSampling
from fl_lightning.core.config import MAX_LOCAL_STEPS
from fl_lightning.reliability.faults import ClientFaults

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5).map(float))
counts = st.one_of(st.none(), st.integers(-3, 50))


def _expect(build, problems: list[str]):
    try:
        build()
    except ValueError as error:
        assert problems, f"valid settings rejected: {error}"
        assert any(p in str(error) for p in problems), f"{error!r} names none of {problems}"
        return
    assert not problems, f"invalid settings accepted: {problems}"


@settings(max_examples=300, deadline=None)
@given(lr=numbers, lr_decay=numbers, steps=st.one_of(counts, st.integers(MAX_LOCAL_STEPS - 2, MAX_LOCAL_STEPS + 2)), epochs=counts, batch_size=counts, weight_decay=numbers)
def test_local_training_validation(lr, lr_decay, steps, epochs, batch_size, weight_decay):
    problems = []
    if not 0 < lr < math.inf:
        problems.append("local.lr")
    if not 0 < lr_decay <= 1:
        problems.append("local.lr_decay")
    if (steps is None) == (epochs is None):
        problems.append("local.steps and local.epochs")
    if steps is not None and not 1 <= steps <= MAX_LOCAL_STEPS:
        problems.append("local.steps")
    if epochs is not None and epochs < 1:
        problems.append("local.epochs")
    if batch_size is not None and batch_size < 1:
        problems.append("local.batch_size")
    if not 0 <= weight_decay < math.inf:
        problems.append("local.weight_decay")
    _expect(lambda: LocalTraining(lr, lr_decay, steps, epochs, batch_size, weight_decay), problems)


@settings(max_examples=200, deadline=None)
@given(dropout=numbers, straggler=numbers, fraction=numbers)
def test_fault_settings_validation(dropout, straggler, fraction):
    problems = []
    if not 0 <= dropout < 1:
        problems.append("faults.dropout")
    if not 0 <= straggler <= 1:
        problems.append("faults.straggler")
    if not 0 < fraction <= 1:
        problems.append("faults.straggler_min_fraction")
    _expect(lambda: ClientFaults(dropout, straggler, fraction), problems)


@settings(max_examples=200, deadline=None)
@given(per_round=st.one_of(st.integers(-3, 40), st.floats(-1, 2, allow_nan=False)), num_clients=st.integers(1, 30))
def test_participation_validation(per_round, num_clients):
    problems = []
    if isinstance(per_round, float) and not 0 < per_round <= 1:
        problems.append("clients_per_round")
    if isinstance(per_round, int) and per_round < 1:
        problems.append("clients_per_round")

    def build():
        sampling = UniformSampling(per_round)
        sampling.validate(num_clients)

    if not problems and sampling_count(per_round, num_clients) > num_clients:
        problems.append(f"exceeds num_clients={num_clients}")
    _expect(build, problems)


def sampling_count(per_round, num_clients):
    return max(1, round(per_round * num_clients)) if isinstance(per_round, float) else per_round


@settings(max_examples=100, deadline=None)
@given(alpha=numbers, min_size=st.integers(-2, 5))
def test_dirichlet_validation(alpha, min_size):
    problems = []
    if not 0 < alpha < math.inf:
        problems.append("alpha")
    if min_size < 1:
        problems.append("min_size")
    _expect(lambda: Dirichlet(alpha, min_size), problems)
    if not problems:
        assert Dirichlet(alpha, min_size).alpha == alpha
