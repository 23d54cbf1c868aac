"""Control variates from the local displacement (SCAFFOLD option II, Karimireddy et al. 2020, Eq. 4).

docs/algorithms.md, (4.2) and (15.2).
"""

from __future__ import annotations

from fl_lightning.core.params import TensorDict


def control_variate_option2(
    c_i: TensorDict, c: TensorDict, x: TensorDict, x_i: TensorDict, num_steps: int, lr: float
) -> TensorDict:
    """c_i+ = c_i - c + (x - x_i) / (K * lr): under plain corrected SGD, the mean of the K raw gradients."""
    scale = 1.0 / (num_steps * lr)
    return {k: c_i[k] - c[k] + (x[k] - x_i[k]) * scale for k in c_i}
