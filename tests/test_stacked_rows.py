"""params.rows_of / across: a batched round's per-client views are read from their stacked source, bit for bit."""

import gc

import torch

from fl_lightning import params as P
from fl_lightning.faults import all_finite
from fl_lightning.metrics import local_consistency


def _stacked(s=6):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(s, 7, 5, generator=g), "b": torch.randn(s, 7, generator=g), "one": torch.randn(s, 1, 3, generator=g)}


def test_across_reads_the_source_of_rows():
    stacked = _stacked()
    views = {k: P.rows_of(v) for k, v in stacked.items()}
    dicts = [{k: views[k][i] for k in views} for i in range(6)]
    for k, v in stacked.items():
        (got,) = P.across(dicts, k)
        assert got is v
        expected = torch.stack([d[k] for d in dicts])
        assert torch.equal(got, expected) and got.stride() == expected.stride() and got.dtype == expected.dtype


def test_same_results_as_stacked_copies():
    stacked = _stacked(9)
    views = {k: P.rows_of(v) for k, v in stacked.items()}
    rows = [{k: views[k][i] for k in views} for i in range(9)]
    copies = [{k: t.clone() for k, t in d.items()} for d in rows]
    weights = torch.rand(9, dtype=torch.float64)
    a, b = P.weighted_sum(rows, weights), P.weighted_sum(copies, weights)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert local_consistency(rows) == local_consistency(copies)
    assert all_finite([{"delta": d} for d in rows]) and all_finite([{"delta": d} for d in copies])


def test_other_lists_are_stacked():
    stacked = _stacked()["w"]
    rows = P.rows_of(stacked)
    for tensors in (rows[:-1], rows[::-1], [rows[0], rows[0], *rows[2:]], [rows[0], rows[1].clone(), *rows[2:]]):
        (got,) = P.across([{"w": t} for t in tensors], "w")
        assert got is not stacked
        assert torch.equal(got, torch.stack(tensors))


def test_only_row_major_sources_are_remembered():
    base = torch.randn(8, 4, 6)
    for stacked in (base.transpose(1, 2), base[1:], base[:, :, :3], torch.randn(6, 3, requires_grad=True)):
        rows = P.rows_of(stacked)
        assert torch.equal(torch.stack(rows), stacked.detach())
        (got,) = P.across([{"x": t} for t in rows], "x")
        assert got is not stacked


def test_forgotten_with_the_rows():
    rows = P.rows_of(torch.randn(5, 3))
    key = id(rows[0])
    assert key in P._STACKED_ROWS
    del rows
    gc.collect()
    assert key not in P._STACKED_ROWS
