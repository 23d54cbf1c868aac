"""Client update rules as pure functions over tensor dicts."""

from fl_lightning.optim.control import control_variate_option2
from fl_lightning.optim.inertial import inertial_step
from fl_lightning.optim.sam import sam_perturbation
from fl_lightning.optim.sgd import sgd_step
from fl_lightning.optim.yogi import Yogi

__all__ = ["Yogi", "control_variate_option2", "inertial_step", "sam_perturbation", "sgd_step"]
