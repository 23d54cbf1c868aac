"""The per-client record of personalized evaluation: ``clients.csv`` in the run's log directory, one row per
client, split and evaluation, appended at every evaluation (``PersonalizedEvaluation``):

``round`` (the 0-based round the evaluation follows, as ``round`` in ``metrics.csv``), ``split`` (``val``: the
validation half of the client's held-out data, ``test``: its test half), ``client``, ``samples``, ``global_acc``
(the global model), ``personal_acc`` (the model the client predicts with; the global one for a method without
personalization), ``seen`` (1: a training client, 0: an unseen one, ``data.new_client_fraction``).

A fit from scratch starts the file anew (as ``metrics.csv``); a resumed fit keeps the rows of the evaluations
before its checkpoint's step and appends; a test appends.
"""

from __future__ import annotations

from fl_lightning.core.round_csv import RoundCsv

FILE = "clients.csv"
COLUMNS = ("round", "split", "client", "samples", "global_acc", "personal_acc", "seen")


class ClientRecord(RoundCsv):
    """Rows appended one evaluation at a time (``append``); ``start`` at a fit's first round."""

    def __init__(self, log_dir: str | None) -> None:
        super().__init__(log_dir, FILE, COLUMNS)
