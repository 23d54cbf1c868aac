"""Compressors and error feedback (docs/algorithms.md, section 21): unbiasedness, exact selection,
the error-feedback identity and pinned byte counts on a known tensor."""

from __future__ import annotations

import math

import pytest
import torch

from fl_lightning.compression import QSGD, Cast, Identity, Int8, RandomK, ScaledSign, TopK, error_feedback, sparse_bytes


def known(d: int = 1000) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, d) ** 3  # distinct magnitudes, one sign change, float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "compressor, nbytes",
    [
        (Identity(), 4000),  # 1000 float32
        (TopK(k=10), 40 + 13),  # 10 values + 10 indices of ceil(log2 1000) = 10 bits
        (TopK(ratio=0.5), 2000 + 125),  # 500 values + the 1000-bit bitmap (smaller than 500 10-bit indices)
        (RandomK(ratio=0.01), 40 + 13),
        (RandomK(k=10, unbiased=True), 40 + 13),
        (QSGD(levels=1), 4 + 250),  # norm + 2 bits (sign, level in {0,1})
        (QSGD(levels=4), 4 + 500),  # sign + ceil(log2 5) = 3 level bits
        (QSGD(levels=255), 4 + 1125),  # sign + 8 level bits
        (ScaledSign(), 4 + 125),  # scale + 1 bit
        (Int8(), 4 + 1000),
        (Cast("float16"), 2000),
        (Cast("bfloat16"), 2000),
    ],
)
def test_pinned_byte_counts(compressor, nbytes):
    x = known()
    out = compressor(x, gen(0))
    assert out.nbytes == nbytes
    assert out.value.shape == x.shape and out.value.dtype == x.dtype


def test_sparse_bytes_index_or_bitmap():
    assert sparse_bytes(16, 1, 4) == 4 + 1  # one 4-bit index
    assert sparse_bytes(16, 4, 2) == 8 + 2  # 4 indices of 4 bits (2 bytes) = the 16-bit bitmap (2 bytes)
    assert sparse_bytes(16, 5, 4) == 20 + 2  # the bitmap is smaller than 5 x 4 bits (3 bytes)
    assert sparse_bytes(1, 1, 4) == 4 + 1  # a one-entry tensor: a 1-bit field


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = torch.randn(500, generator=gen(3))
    for k in (1, 7, 250, 500):
        out = TopK(k=k)(x).value
        kept = out != 0
        assert int(kept.sum()) == k
        assert torch.equal(out[kept], x[kept])  # kept values are sent exactly
        assert x[kept].abs().min() >= (x[~kept].abs().max() if k < 500 else 0)
    assert TopK(ratio=0.1)(x.reshape(20, 25)).value.count_nonzero() == 50  # k = ceil(0.1 * 500), any shape


def test_randomk_keeps_k_entries_from_the_generator():
    x = torch.randn(100, generator=gen(4))
    a, b, c = (RandomK(k=10)(x, gen(s)).value for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)  # the draw is the generator's
    assert int((a != 0).sum()) == 10 and torch.equal(a[a != 0], x[a != 0])
    scaled = RandomK(k=10, unbiased=True)(x, gen(1)).value
    assert torch.equal(scaled, a * 10.0)  # d/k = 10


def unbiased_within(compressor, x: torch.Tensor, draws: int, std_bound: torch.Tensor) -> None:
    """The mean of ``draws`` seeded draws lies within 5 standard deviations (a per-coordinate bound) of x."""
    mean = torch.stack([compressor(x, gen(s)).value.double() for s in range(draws)]).mean(0)
    tolerance = 5 * std_bound / math.sqrt(draws)
    assert ((mean - x.double()).abs() <= tolerance).all(), float(((mean - x.double()).abs() / tolerance).max())


def test_qsgd_is_unbiased():
    x = torch.randn(64, generator=gen(5))
    norm = float(torch.linalg.vector_norm(x.double()))
    for s in (1, 4):
        # each coordinate is (norm/s) sign(x_i) times a level l or l+1: variance <= (norm / s)^2 / 4
        unbiased_within(QSGD(levels=s), x, 4000, torch.full((64,), norm / s / 2, dtype=torch.float64))


def test_scaled_randomk_is_unbiased():
    x = torch.randn(40, generator=gen(6))
    d, k = 40, 8  # x_i d/k with probability k/d: variance x_i^2 (d/k - 1)
    unbiased_within(RandomK(k=k, unbiased=True), x, 4000, x.double().abs() * math.sqrt(d / k - 1))


def test_qsgd_hand_worked():
    # v = (3, -4), ||v|| = 5, s = 2: s|v_i|/||v|| = 1.2 and 1.6, so levels {1, 2}, decoded on the grid 2.5 * level
    v = torch.tensor([3.0, -4.0])
    seen = {tuple(QSGD(levels=2)(v, gen(s)).value.tolist()) for s in range(200)}
    assert seen == {(2.5, -2.5), (2.5, -5.0), (5.0, -2.5), (5.0, -5.0)}
    assert torch.equal(QSGD(levels=3)(torch.zeros(5), gen(0)).value, torch.zeros(5))


def test_scaled_sign_int8_and_casts_hand_worked():
    v = torch.tensor([1.0, -3.0, 0.0, 4.0])
    assert ScaledSign()(v).value.tolist() == [2.0, -2.0, 2.0, 2.0]  # ||v||_1 / d = 2; sign(0) = +1
    q = Int8()(torch.tensor([127.0, -63.4, 0.6, 0.4]))
    assert q.value.tolist() == [127.0, -63.0, 1.0, 0.0]  # a = 1: round to nearest
    assert Cast("float16")(torch.tensor([1.0 + 2**-12])).value.item() == 1.0
    assert Cast("bfloat16")(torch.tensor([1.0 + 2**-9])).value.item() == 1.0


@pytest.mark.parametrize("compressor", [TopK(k=30), RandomK(k=30), Cast("float16"), Cast("bfloat16")])
def test_error_feedback_identity_exact(compressor):
    """sent + e' == x + e bitwise: sparsifiers send entries of x + e as they are (e' is 0 or x + e);
    a cast's round-to-nearest value lies within a factor 2 of x + e, so x + e - sent is exact (Sterbenz)."""
    x, e = torch.randn(200, generator=gen(7)), 0.1 * torch.randn(200, generator=gen(8))
    for step in range(3):
        sent, new = error_feedback(compressor, x, e, gen(step))
        assert torch.equal(sent.value + new, x + e)
        e = new


@pytest.mark.parametrize("compressor", [QSGD(levels=2), ScaledSign(), Int8(), RandomK(k=30, unbiased=True)])
def test_error_feedback_identity_to_rounding(compressor):
    """e' is x + e - sent rounded once: sent + e' equals x + e to half an ulp of e' (exactly, where the
    subtraction is exact); the residual is the definition bitwise."""
    x, e = torch.randn(200, generator=gen(9)), 0.1 * torch.randn(200, generator=gen(10))
    sent, new = error_feedback(compressor, x, e, gen(0))
    assert torch.equal(new, (x + e) - sent.value)
    gap = ((sent.value.double() + new.double()) - (x + e).double()).abs()
    assert (gap <= new.double().abs() * 2**-24).all()


def test_error_feedback_without_residual_is_the_compressor():
    x = torch.randn(50, generator=gen(11))
    sent, new = error_feedback(TopK(k=5), x, None)
    assert torch.equal(sent.value, TopK(k=5)(x).value) and torch.equal(new, x - sent.value)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TopK(k=0), "TopK.k must be an integer >= 1, got 0"),
        (lambda: RandomK(k=-3), "RandomK.k must be an integer >= 1, got -3"),
        (lambda: TopK(ratio=0.0), "TopK.ratio must be in (0, 1], got 0.0"),
        (lambda: TopK(ratio=1.5), "TopK.ratio must be in (0, 1], got 1.5"),
        (lambda: TopK(), "TopK takes exactly one of ratio"),
        (lambda: QSGD(levels=0), "QSGD.levels (s) must be an integer >= 1, got 0"),
        (lambda: Cast("int4"), "Cast.dtype must be one of"),
    ],
)
def test_bad_settings_one_line(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_k_larger_than_the_tensor():
    with pytest.raises(ValueError, match="TopK.k must be <= the size of every tensor it compresses, got k=11"):
        TopK(k=11)(torch.ones(10))


@pytest.mark.parametrize("compressor", [Identity(), TopK(k=5), RandomK(k=5), ScaledSign()])
def test_declared_norm_bound_holds(compressor):
    """``never_increases_norm``: ||C(v)|| <= ||v|| (a clipped upload stays clipped under privacy)."""
    assert compressor.never_increases_norm
    for seed in range(20):
        v = torch.randn(50, generator=gen(seed)) * torch.rand(50, generator=gen(100 + seed)) ** 4  # uneven magnitudes
        assert torch.linalg.vector_norm(compressor(v, gen(seed)).value) <= torch.linalg.vector_norm(v)


def test_norm_increasing_compressors_do_not_declare_the_bound():
    v = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert not RandomK(k=1, unbiased=True).never_increases_norm and not QSGD(levels=1).never_increases_norm
    assert max(float(torch.linalg.vector_norm(QSGD(levels=1)(torch.tensor([0.6, 0.8]), gen(s)).value)) for s in range(20)) > 1.0
    assert not Int8().never_increases_norm and not Cast("bfloat16").never_increases_norm


def test_compression_under_privacy_needs_a_norm_bound_and_no_uplink_feedback():
    from fl_lightning.compression import Compression

    Compression(up=TopK(ratio=0.1), down=QSGD(levels=2), error_feedback_up=False).check_with_privacy()
    with pytest.raises(ValueError, match=r"^compression.up=QSGD\(levels=2\) can increase an upload's norm beyond privacy's clip norm C"):
        Compression(up=QSGD(levels=2), error_feedback_up=False).check_with_privacy()
    with pytest.raises(ValueError, match=r"^compression.error_feedback_up must be false under privacy"):
        Compression(up=TopK(ratio=0.1)).check_with_privacy()


def test_error_feedback_makes_unbiased_compressors_contractive():
    """An unbiased compressor of variance omega feeds back C / (1 + omega): a residual that would grow
    with QSGD s=1 itself (omega = min(d, sqrt(d)) = 10 for d = 100) stays bounded."""
    assert QSGD(levels=1).variance(100) == 10.0 and QSGD(levels=20).variance(100) == 0.25
    assert RandomK(k=10, unbiased=True).variance(100) == 9.0 and RandomK(k=10).variance(100) == 0.0
    x = torch.randn(100, generator=gen(12))
    sent, _ = error_feedback(QSGD(levels=1), x, None, gen(0))
    assert torch.equal(sent.value, QSGD(levels=1)(x, gen(0)).value / 11.0)
    scaled, _ = error_feedback(RandomK(k=10, unbiased=True), x, None, gen(0))
    assert torch.allclose(scaled.value, RandomK(k=10)(x, gen(0)).value)  # d/k / (1 + d/k - 1): unscaled random-k
    e = None
    for step in range(300):  # a constant input: the residual stays within a few norms of it
        _, e = error_feedback(QSGD(levels=1), x, e, gen(step))
    assert torch.linalg.vector_norm(e) < 20 * torch.linalg.vector_norm(x)
