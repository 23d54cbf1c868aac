"""Federated LoRA aggregation methods (docs/algorithms.md, section 28): each rule against its own numpy
reference on random factors of mixed ranks, the exactness claims, and the runs on a tiny GPT-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.lora import METHODS, LayerRound, Stacked, resolve
from tests.lora_reference import REFERENCES, padded, target

RANKS = [2, 4, 8, 3]
OUT, IN, RANK = 12, 10, 8


def random_factors(seed=0, ranks=RANKS):
    rng = np.random.default_rng(seed)
    a = [rng.normal(size=(r, IN)) for r in ranks]
    b = [rng.normal(size=(OUT, r)) for r in ranks]
    w = rng.uniform(0.5, 2.0, size=len(ranks))
    return a, b, w / w.sum()


def run_method(name, a, b, w, rank=RANK):
    """The method's LayerUpdate, in float64, on the given (numpy) factors."""
    t = lambda v: torch.from_numpy(v)  # noqa: E731
    return METHODS[name]().layer([t(x) for x in a], [t(x) for x in b], torch.from_numpy(w), LayerRound(rank, torch.Generator().manual_seed(0)))


def aggregated(name, a, b, w, rank=RANK):
    """The product the server's model adds after the round, s=1: B' A' + fold (A', B' = the factor means when the method keeps them)."""
    up = run_method(name, a, b, w, rank)
    mean_a, mean_b, _ = REFERENCES["factors"](a, b, w, rank)
    new_a = up.a.numpy() if up.a is not None else mean_a
    new_b = up.b.numpy() if up.b is not None else mean_b
    return new_b @ new_a + (up.fold.numpy() if up.fold is not None else 0.0)


@pytest.mark.parametrize("name", list(REFERENCES))
def test_each_rule_equals_its_numpy_reference_on_mixed_rank_factors(name):
    a, b, w = random_factors()
    up = run_method(name, a, b, w)
    ref_a, ref_b, ref_fold = REFERENCES[name](a, b, w, RANK)
    if name == "factors":  # no rule of its own: the algorithm's mean of the factors stands
        assert up.a is None and up.b is None and up.fold is None
        return
    if name == "stacked":  # a fresh random A (peft's init); compared on B = 0 and the fold
        assert up.a.shape == (RANK, IN) and float(up.a.abs().max()) > 0
        ref_a = up.a.numpy()
    for got, ref in ((up.a, ref_a), (up.b, ref_b), (up.fold, ref_fold)):
        if ref is None:  # the method keeps the algorithm's factors, or folds nothing
            assert got is None, name
        else:
            assert got is not None and np.allclose(got.numpy(), ref, rtol=1e-10, atol=1e-10), name


def exactness_table(seed=0):
    a, b, w = random_factors(seed)
    want = target(a, b, w)
    return {name: float(np.abs(aggregated(name, a, b, w) - want).max()) for name in REFERENCES}


def test_exactness_claims_hold_on_random_mixed_rank_factors():
    """FLoRA and FedEx-LoRA reproduce sum_i w_i B_i A_i to float64 rounding; FedIT and HetLoRA do not; FlexLoRA
    is exact once the rank holds the update's rank and otherwise its best rank-r approximation (Eckart-Young)."""
    gaps = exactness_table()
    assert gaps["stacked"] < 1e-12 and gaps["exact_residual"] < 1e-12
    assert gaps["factors"] > 1e-2 and gaps["zero_pad"] > 1e-2 and gaps["svd"] > 1e-2
    a, b, w = random_factors()
    want = target(a, b, w)
    assert np.abs(aggregated("svd", a, b, w, rank=IN) - want).max() < 1e-10  # rank(ΔW) <= min(out, in) = 10
    s = np.linalg.svd(want, compute_uv=False)
    assert np.isclose(np.linalg.norm(aggregated("svd", a, b, w) - want, 2), s[RANK])  # the (r+1)-th singular value


def test_hetlora_truncation_is_the_first_components_and_its_weights_follow_the_norms():
    """(28.5)-(28.6): zero-padding to r then keeping the first r_i components gives back a rank-r_i factor pair;
    a client whose B_i A_i is zero gets weight 0."""
    a, b, w = random_factors(1, ranks=[2, 8])
    b[0] = np.zeros_like(b[0])
    up = run_method("zero_pad", a, b, w)
    assert np.allclose(up.a.numpy(), padded(a[1], b[1], RANK)[0]) and np.allclose(up.b.numpy(), b[1])


def test_flora_state_stays_one_adapter_and_its_fresh_a_is_seeded():
    a, b, w = random_factors(2)
    one = run_method("stacked", a, b, w)
    two = run_method("stacked", a, b, w)
    assert one.a.shape == (RANK, IN) and one.b.shape == (OUT, RANK) and float(one.b.abs().max()) == 0.0
    assert torch.equal(one.a, two.a)  # from the round's generator: a resume draws the same


def test_unknown_method_and_bad_ranks_are_one_line():
    with pytest.raises(ValueError, match="model.lora_aggregation must be one of factors, stacked"):
        resolve("mean")
    with pytest.raises(ValueError, match="ranks must be a non-empty list of ranks >= 1"):
        Stacked(ranks=[0, 2])
    with pytest.raises(ValueError, match="set ranks .by client id. or tiers .drawn by seed., not both"):
        Stacked(ranks=[2], tiers=[2, 4])


def test_rank_rules_by_client_id_and_tiers_drawn_by_seed():
    assert [Stacked(ranks=[2, 4, 8]).rank_of(c, 8) for c in range(5)] == [2, 4, 8, 2, 4]
    assert [Stacked().rank_of(c, 8) for c in range(3)] == [8, 8, 8]
    drawn = [Stacked(tiers=[2, 4, 8], seed=3).rank_of(c, 8) for c in range(60)]
    assert drawn == [Stacked(tiers=[2, 4, 8], seed=3).rank_of(c, 8) for c in range(60)]  # a function of (seed, client)
    assert set(drawn) == {2, 4, 8} and drawn != [Stacked(tiers=[2, 4, 8], seed=4).rank_of(c, 8) for c in range(60)]
