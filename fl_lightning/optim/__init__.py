"""Client update rules as pure functions over tensor dicts."""

from fl_lightning.optim.sgd import sgd_step

__all__ = ["sgd_step"]
