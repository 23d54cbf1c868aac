"""Byzantine-robust aggregation rules (docs/robustness.md, docs/algorithms.md 26.1)."""

from fl_lightning.robust.aggregation import RULES, Robust, RoundOutcome
from fl_lightning.robust.base import Combined, RobustRule
from fl_lightning.robust.bulyan import Bulyan
from fl_lightning.robust.centered_clipping import CenteredClipping
from fl_lightning.robust.fltrust import FLTrust
from fl_lightning.robust.geometric_median import GeometricMedian
from fl_lightning.robust.krum import Krum, MultiKrum
from fl_lightning.robust.median import Median
from fl_lightning.robust.norm_bound import NormBound
from fl_lightning.robust.trimmed_mean import TrimmedMean

__all__ = [
    "RULES", "Bulyan", "CenteredClipping", "Combined", "FLTrust", "GeometricMedian", "Krum", "MultiKrum", "Median", "NormBound", "Robust",
    "RobustRule", "RoundOutcome", "TrimmedMean",
]
