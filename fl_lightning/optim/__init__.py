"""Client update rules as pure functions over tensor dicts."""

from fl_lightning.optim.sgd import sgd_step
from fl_lightning.optim.svrg import svrg_direction, svrg_step

__all__ = ["sgd_step", "svrg_direction", "svrg_step"]
