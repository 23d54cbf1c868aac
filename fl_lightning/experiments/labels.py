"""What a number of a comparison was measured on: each logged accuracy's human label, naming its
split (validation, test, client holdout, unseen clients) and its model (global, personalized).

``compare``'s tables (tables.py) build every row and heading from this mapping, so a metric logged
in ``metrics.csv`` that is listed here becomes a labelled row when present; the progress line of
each run (compare.py) uses the same words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from fl_lightning.experiments.history import ACC, TEST_ACC

GLOBAL = "global model"
PERSONAL = "personalized models"
UNSEEN = "unseen clients' personalized models"

FINAL = "final evaluation"
AT_BEST_VAL = "at the best-validation evaluation"
BEST_ON_TEST = "best evaluation (selected on the test set)"


@dataclass(frozen=True)
class Measured:
    """``quantity`` names the split; ``model`` which model was evaluated on it; ``higher_is_better`` which way
    the tables mark the best run."""

    quantity: str
    model: str
    higher_is_better: bool = True

    def row(self, when: str) -> str:
        """A table row: ``Test accuracy, global model, final evaluation (%)``."""
        return f"{self.quantity}, {self.model}, {when} (%)"

    def short(self) -> str:
        """``test accuracy (global model)``: a heading's words."""
        return f"{self.quantity[0].lower()}{self.quantity[1:]} ({self.model})"


METRICS: dict[str, Measured] = {  # metric in metrics.csv -> what it measured; table rows in this order
    ACC: Measured("Validation accuracy", GLOBAL),
    TEST_ACC: Measured("Test accuracy", GLOBAL),
    "clients/acc_mean": Measured("Client-holdout accuracy (mean over clients)", GLOBAL),
    "clients/acc_worst10": Measured("Client-holdout accuracy (worst 10% of clients)", GLOBAL),
    # Personalized FL (docs/personalization.md, "Evaluation protocol"): on the clients' held-out split (val/: its validation half, test/: its test half);
    # val/ rows are the last evaluation during training, test/ rows the final model's test stage.
    "val/personal_acc_mean": Measured("Personalized accuracy (client holdout, validation half, mean over clients)", PERSONAL),
    "val/personal_acc_weighted": Measured("Personalized accuracy (client holdout, validation half, weighted by size)", PERSONAL),
    "val/personal_acc_worst10": Measured("Personalized accuracy (client holdout, validation half, worst 10% of clients)", PERSONAL),
    "val/unseen_acc_mean": Measured("Unseen-client accuracy (client holdout validation half after personalization, mean)", UNSEEN),
    "val/unseen_acc_worst10": Measured("Unseen-client accuracy (client holdout validation half after personalization, worst 10%)", UNSEEN),
    "test/personal_acc_mean": Measured("Personalized accuracy at test (client holdout, test half, mean over clients)", PERSONAL),
    "test/personal_acc_worst10": Measured("Personalized accuracy at test (client holdout, test half, worst 10% of clients)", PERSONAL),
    "test/personal_acc_weighted": Measured("Personalized accuracy at test (client holdout, test half, weighted by size)", PERSONAL),
    "test/unseen_acc_mean": Measured("Unseen-client accuracy at test (client holdout test half after personalization, mean)", UNSEEN),
    # Attacks (docs/robustness.md, "Attacks"): a backdoor's success on the test set's triggered inputs of other classes.
    "attack/backdoor_asr": Measured("Backdoor attack success rate (triggered test inputs of non-target classes)", GLOBAL),
}
EXTRA = [metric for metric in METRICS if metric not in (ACC, TEST_ACC)]  # rows added when logged


BELOW = re.compile(r"(val|test)/(personal|unseen)_acc_below([\d.]+)")
"""The share of clients below an accuracy threshold in percent (``PersonalizedEvaluation.below``): rows where logged."""


def below_metrics(logged: Iterable[str]) -> list[str]:
    """The logged ``<stage>/<personal|unseen>_acc_below<p>`` metrics: test before validation, then by threshold."""
    found = [BELOW.fullmatch(m) for m in logged]
    return [m[0] for m in sorted(filter(None, found), key=lambda m: (m[1] != "test", m[2], float(m[3])))]


def measured(metric: str, validation_split: bool = True) -> Measured:
    """What ``metric`` measured; without a validation split ``val/acc`` is the test set's accuracy."""
    if metric == ACC and not validation_split:
        return METRICS[TEST_ACC]
    below = BELOW.fullmatch(metric)
    if below is not None:
        stage, who, percent = below.groups()
        clients, at = "clients" if who == "personal" else "unseen clients", " at test" if stage == "test" else ""
        half = "test half" if stage == "test" else "validation half"
        return Measured(f"Share of {clients} below {percent}% accuracy{at} (client holdout, {half})", PERSONAL if who == "personal" else UNSEEN,
                        higher_is_better=False)  # fmt: skip
    return METRICS[metric]
