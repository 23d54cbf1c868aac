"""Client update rules as pure functions over tensor dicts.

May import: core.
"""

from fl_lightning.optim.control import control_variate_option2
from fl_lightning.optim.inertial import inertial_step
from fl_lightning.optim.sam import sam_perturbation
from fl_lightning.optim.sgd import sgd_step
from fl_lightning.optim.svrg import svrg_direction, svrg_step
from fl_lightning.optim.tracked_adam import adam_direction, adam_round_init, tracked_adam_step
from fl_lightning.optim.yogi import Yogi

__all__ = [
    "Yogi",
    "adam_direction",
    "adam_round_init",
    "control_variate_option2",
    "inertial_step",
    "sam_perturbation",
    "sgd_step",
    "svrg_direction",
    "svrg_step",
    "tracked_adam_step",
]
