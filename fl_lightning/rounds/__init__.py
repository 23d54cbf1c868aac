"""The server side of a round as a chain of declared stages (docs/architecture.md, "Round stages").

A stage is a ``RoundStage`` subclass implementing only the hooks it needs; ``FederatedModule(stages=[...])``
(``model.stages`` in YAML) adds a user's own beside the shipped ones.
"""

from fl_lightning.rounds.stage import ACCOUNT, ADMIT, AFTER, AGGREGATE, ATTACK, BROADCAST, CHECK, FILTER, NOISE, SHAPE, Cohort, Round, RoundStage, RunFacts

__all__ = ["ACCOUNT", "ADMIT", "AFTER", "AGGREGATE", "ATTACK", "BROADCAST", "CHECK", "FILTER", "NOISE", "SHAPE", "Cohort", "Round", "RoundStage", "RunFacts"]
