"""The ``attack`` setting (docs/robustness.md, "Attacks"; docs/algorithms.md, 26.2): who is malicious,
how their data is poisoned and how their uploads are replaced."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from fl_lightning.adversary.base import DataPoisoning, RoundView, UploadAttack, split_batch
from fl_lightning.adversary.flat import flatten, unflatten
from fl_lightning.adversary.malicious import MaliciousClients, check_fraction, choose_malicious
from fl_lightning.adversary.poisoned_data import PoisonedData
from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.core.tasks import ClientResult, ClientTask
from fl_lightning.pipeline.messages import sends_no_model_shaped_upload

log = logging.getLogger(__name__)


class Attack:
    """A fixed set of malicious clients, drawn once per run from ``data.seed``, that poison their training
    data (``data``) and/or replace their uploads (``upload``).

    Args:
        fraction: the share of the N clients that is malicious, in [0, 1): ``round(fraction * N)`` of them
            (at least one when > 0), drawn by ``derive_seed(data.seed, MALICIOUS_STREAM)``.
        clients: the malicious clients' ids instead of ``fraction``.
        data: data poisoning of their batches (``LabelFlip``, ``Backdoor``).
        upload: model poisoning of their uploads (``ModelReplacement``, ``SignFlip``, ``GaussianUpload``,
            ``ALIE``, ``IPM``, ``MinMax``, ``MinSum``).

    ``malicious`` (a ``MaliciousClients``, ``.ids``) is set when training starts; other components may read it.
    """

    def __init__(
        self,
        fraction: float = 0.0,
        clients: list[int] | None = None,
        data: DataPoisoning | None = None,
        upload: UploadAttack | None = None,
    ) -> None:
        check_fraction(fraction)
        if clients is not None and fraction:
            raise ValueError(f"attack: set attack.fraction ({fraction}) or attack.clients ({clients}), not both")
        if data is None and upload is None:
            raise ValueError("attack sets neither attack.data nor attack.upload: name a data poisoning or an upload attack")
        self.fraction, self.clients, self.data, self.upload = fraction, clients, data, upload
        self.malicious: MaliciousClients | None = None
        self._metrics: dict[str, float] = {}

    @property
    def backdoor(self) -> DataPoisoning | None:
        """The data poisoning if it has a trigger to evaluate (``attack/backdoor_asr``)."""
        return self.data if self.data is not None and type(self.data).triggered is not DataPoisoning.triggered else None

    def prepare(self, num_clients: int, seed: int, num_classes: int | None, algorithm: Any, processes: int, record_privacy: bool) -> None:
        """The refusals (one line each), then the malicious set; before any training."""
        name = type(self.upload).__name__
        if self.upload is not None and sends_no_model_shaped_upload(algorithm):
            raise ValueError(
                f"attack.upload {name} cannot attack {type(algorithm).__name__}: its uploads are not shaped like the model "
                "(upload_entries is empty, e.g. FedProto's class prototypes); use a data poisoning (attack.data) instead"
            )
        if self.upload is not None and self.upload.needs_benign and processes > 1:
            raise ValueError(
                f"attack.upload {name} reads every benign upload of the round, but under DDP ({processes} processes) each "
                "process holds only its own clients' uploads; run it in one process (--trainer.devices 1)"
            )
        if self.data is not None:
            if num_classes is None:
                raise ValueError("attack.data needs a classification dataset (the data module has no num_classes)")
            if record_privacy:
                raise ValueError("attack.data cannot poison record-level DP-SGD's sampled records (record_privacy); use one or the other")
            self.data.check(num_classes)
        self.malicious = choose_malicious(num_clients, seed, self.fraction, self.clients)
        self.num_classes = num_classes

    def check_data(self, data: Any) -> None:
        """Poison one sample of the first malicious client once, before training: a batch that is not
        (inputs, labels), or a trigger larger than the images, is one line then rather than a client error later."""
        if self.data is None or self.malicious is None or not len(self.malicious):
            return
        inputs, labels = split_batch(data.client_full_batch(self.malicious.ids[0]))
        self.data.poison(inputs[:1], labels[:1], self.num_classes, torch.Generator().manual_seed(0))

    def data_view(self, data: Any) -> Any:
        """``data`` as the clients train on it: the malicious clients' batches poisoned (``data`` itself without ``attack.data``)."""
        if self.data is None or self.malicious is None or not len(self.malicious):
            return data
        return PoisonedData(data, self.malicious, self.data, self.num_classes)

    # ---- the round ------------------------------------------------------------------------------
    def tamper(self, results: list[ClientResult], tasks: Sequence[ClientTask], info: RoundInfo, algorithm: Any) -> list[ClientResult]:
        """The round's results with the malicious clients' uploads replaced by ``upload.craft`` (the warm-up
        pass's left as they are); records the round's ``attack/*`` metrics."""
        warmup = {t.client_id for t in tasks if t.warmup}
        trained = [i for i, r in enumerate(results) if r.client_id not in warmup]
        if not trained or self.malicious is None:
            return results
        bad = [i for i in trained if results[i].client_id in self.malicious]
        good = [i for i in trained if results[i].client_id not in self.malicious]
        shaped = not sends_no_model_shaped_upload(algorithm)
        out = list(results)
        if self.upload is not None and bad and shaped:
            if self.upload.needs_benign and len(good) < 2:
                log.warning(
                    "round %d: attack.upload %s needs at least 2 benign uploads, the round has %d: "
                    "its %d malicious clients send their trained updates",
                    info.round, type(self.upload).__name__, len(good), len(bad),
                )  # fmt: skip
            else:
                seeds = {t.client_id: t.seed for t in tasks}
                view = RoundView(info.round, len(trained), len(bad), float(getattr(algorithm, "global_lr", 1.0)),
                                 tuple(seeds[results[i].client_id] for i in bad))  # fmt: skip
                crafted = self.upload.craft(self._rows(results, bad), self._rows(results, good), view)
                for row, i in enumerate(bad):
                    out[i] = dataclasses.replace(results[i], upload=unflatten(crafted[row], results[i].upload))
        self._metrics = {"attack/malicious_clients": float(len(bad))}
        for key, rows in (("attack/norm_benign", good), ("attack/norm_malicious", bad)):
            if rows and shaped:
                self._metrics[key] = float(torch.linalg.vector_norm(self._rows(out, rows), dim=1).mean())
        return out

    @staticmethod
    def _rows(results: list[ClientResult], indices: list[int]) -> torch.Tensor:
        """The uploads of ``results[i]``, i in ``indices``, as the rows of a float64 matrix (``[0, 0]`` for none)."""
        if not indices:
            return torch.zeros(0, 0, dtype=torch.float64)
        return torch.stack([flatten(results[i].upload) for i in indices])

    def round_metrics(self) -> dict[str, float]:
        """The last round's ``attack/*`` metrics (then cleared)."""
        metrics, self._metrics = self._metrics, {}
        return metrics
