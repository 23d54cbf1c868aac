"""Secure aggregation (SecAgg, SecAgg+) with distributed DP, simulated message by message (docs/privacy.md,
"Secure aggregation and distributed DP"; docs/algorithms.md, section 31)."""

from fl_lightning.secagg.aggregation import SecureAggregation, SecureSum
from fl_lightning.secagg.shamir import TooFewShares

__all__ = ["SecureAggregation", "SecureSum", "TooFewShares"]
