"""Tensor-dict helpers: stacked rows read back without a copy."""

import torch

from fl_lightning.core import params as P


def test_across_returns_the_stacked_tensor_of_its_rows():
    """Rows from ``unstack_rows`` come back from ``across`` as the stacked tensor itself (no copy), equal to
    ``torch.stack``; a prefix of the rows as its first rows; a replaced row, or rows of another stack, are stacked again."""
    stacked = {"w": torch.randn(5, 3, 2), "b": torch.randn(5, 4)}
    rows = P.unstack_rows(stacked, 5)
    assert all(torch.equal(rows[i]["w"], stacked["w"][i]) for i in range(5))
    (whole,) = P.across(rows, "w")
    assert whole.data_ptr() == stacked["w"].data_ptr() and torch.equal(whole, torch.stack([r["w"] for r in rows]))
    (prefix,) = P.across(rows[:3], "b")
    assert prefix.data_ptr() == stacked["b"].data_ptr() and torch.equal(prefix, stacked["b"][:3])
    changed = [dict(r) for r in rows]
    changed[2]["w"] = changed[2]["w"] + 1.0  # a message stage's new tensor: not a row of the stack
    (restacked,) = P.across(changed, "w")
    assert restacked.data_ptr() != stacked["w"].data_ptr() and torch.equal(restacked[2], stacked["w"][2] + 1.0)
    (skipped,) = P.across(rows[1:3], "w")  # rows 1..2 are not the stack's first rows
    assert torch.equal(skipped, stacked["w"][1:3])
    weights = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    assert torch.equal(P.weighted_sum(rows, weights)["w"], P.weighted_sum([dict(r) for r in rows], weights)["w"])


def test_non_contiguous_stacks_are_stacked_again():
    stacked = {"w": torch.randn(3, 4).t()}  # [4, 3], not contiguous
    rows = P.unstack_rows(stacked, 4)
    (again,) = P.across(rows, "w")
    assert again.is_contiguous() and torch.equal(again, stacked["w"])
