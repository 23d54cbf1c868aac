"""Staleness weights s(tau) of an update computed from a model tau server versions old (docs/algorithms.md, (27.7))."""

from __future__ import annotations


def staleness_weight(kind: str, tau: int, exponent: float = 0.5, hinge_a: float = 10.0, hinge_b: int = 4) -> float:
    """``constant``: 1; ``polynomial``: (1 + tau)^-exponent; ``hinge``: 1 for tau <= b, else 1 / (a (tau - b) + 1)
    (Xie et al., 2019)."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((1.0 + tau) ** -exponent)
    if kind == "hinge":
        return 1.0 if tau <= hinge_b else 1.0 / (hinge_a * (tau - hinge_b) + 1.0)
    raise ValueError(f"asynchronous.staleness must be 'constant', 'polynomial' or 'hinge', got {kind!r}")
