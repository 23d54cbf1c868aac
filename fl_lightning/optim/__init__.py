"""Client update rules as pure functions over tensor dicts."""

from fl_lightning.optim.sgd import sgd_step
from fl_lightning.optim.tracked_adam import adam_direction, adam_round_init, tracked_adam_step

__all__ = ["adam_direction", "adam_round_init", "sgd_step", "tracked_adam_step"]
