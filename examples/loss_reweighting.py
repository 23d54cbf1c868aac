"""Clients weighted by their training loss: a round stage of your own (docs/architecture.md, "Your own stage").

    fl-lightning fit --import loss_reweighting --config quickstart \
        --model.stages '[{class_path: loss_reweighting.LossReweighting, init_args: {power: 2.0}}]'
"""

import torch

from fl_lightning.rounds import AGGREGATE, RoundStage


class LossReweighting(RoundStage):
    """Each reporting client's aggregation weight in proportion to its mean training loss to the ``power``
    (the clients the model serves worst count more; ``power`` 0 weighs them equally). Logs the largest share."""

    name = "loss_reweighting"
    order = AGGREGATE - 5
    setting = "model.stages"
    reads_each_upload = True  # every client's loss is needed: the round is gathered, not summed across processes
    conflicts = {"privacy": "client-level DP's noise is calibrated to fixed weights"}

    def __init__(self, power: float = 1.0) -> None:
        if not power >= 0:
            raise ValueError(f"LossReweighting.power must be >= 0, got {power}")
        self.power = power

    def aggregation_weights(self, round):
        def weights(reporting):
            loss = dict(zip(round.results.client_ids, round.results.mean_losses))
            w = torch.tensor([loss[c] ** self.power for c in reporting], dtype=torch.float64)
            round.metrics["reweight/max_share"] = float(w.max() / w.sum())
            return w / w.sum()

        return weights
