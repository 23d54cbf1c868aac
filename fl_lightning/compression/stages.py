"""Compression as message-pipeline stages (``fl_lightning/pipeline/messages.py``), and its setting.

Uplink (``CompressUploads``, a ``ClientStage``): every entry of a client's upload (FedAvg's
``delta``, SCAFFOLD's ``delta_c``, ...) is compressed on the client; with error feedback the
residual of each entry is that client's state ``msg:compress:<entry>`` in the client store
(checkpointed with it), (24.6). Downlink (``CompressBroadcast``, a ``BroadcastStage``): every entry
of the broadcast is compressed once a round on the server; with error feedback the server sends
the compressed change of each entry since what the clients hold and keeps that copy (24.7).
Randomness: the client's round seed or the server's round seed (``StageKey``), one stream per link.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from fl_lightning.core import params as P
from fl_lightning.compression.base import Compressor
from fl_lightning.compression.feedback import shrink_factors, uplink_feedback
from fl_lightning.compression.messages import check_entry_sizes, compress_entry
from fl_lightning.pipeline.messages import COMPRESS, BroadcastStage, ClientStage, Sent, StageKey, sends_no_model_shaped_upload
from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import Payload

log = logging.getLogger(__name__)
UP_STREAM, DOWN_STREAM = 0xC0DE, 0xC0DF
"""Seed streams of the uplink (per client) and downlink (per round) compressors."""


def _device(message: Payload) -> torch.device:
    for entry in message.values():
        for tensor in entry.values():
            return tensor.device
    return torch.device("cpu")


def mirrored_uploads(algorithm: Any) -> tuple[str, ...]:
    """Upload entries that are increments of a client state the server mirrors in its own state
    (SCAFFOLD's ``delta_c``: c = mean_i c_i), as the algorithm's class declares them."""
    return tuple(getattr(algorithm, "mirrored_uploads", ()))


class CompressUploads(ClientStage):
    """Each client compresses each entry of its upload (with error feedback: of upload + residual)."""

    order = COMPRESS
    name = "compress"

    def __init__(self, compressor: Compressor, error_feedback: bool = True, flatten: bool = False) -> None:
        self.compressor, self.error_feedback, self.flatten = compressor, error_feedback, flatten
        self._stale_reported = False

    def check(self, algorithm: Any, num_clients: int) -> None:
        if sends_no_model_shaped_upload(algorithm):
            raise ValueError(
                f"compression.up cannot compress {type(algorithm).__name__}'s uploads: they are not shaped like the model "
                "(its upload_entries is empty, e.g. FedProto's class prototypes); remove compression.up"
            )
        mirrored = mirrored_uploads(algorithm)
        if mirrored and not self.compressor.unbiased and not self.error_feedback:
            raise ValueError(
                f"compression.up={self.compressor.describe()} is biased and compression.error_feedback_up is false: "
                f"{type(algorithm).__name__}'s server state sums the uploaded {', '.join(mirrored)} and would drift away from "
                "its clients' own state; set compression.error_feedback_up true or use an unbiased compressor (QSGD, RandomK with unbiased: true)"
            )

    def apply(self, upload: Payload, state: NestedState, key: StageKey) -> Sent:
        generator = key.generator(UP_STREAM, _device(upload)) if self.compressor.randomized else None
        if state and not self.error_feedback and not self._stale_reported:
            self._stale_reported = True  # a resume of a run with error feedback (e.g. QSGD under the former default)
            log.warning(
                "client %d holds uplink compression residuals (%s) but compression.error_feedback_up is off for %s: they are not "
                "sent; set compression.error_feedback_up true to continue a run that used error feedback as it was",
                key.client, ", ".join(sorted(state)), self.compressor.describe(),
            )  # fmt: skip
        message, new_state, total = {}, dict(state), 0
        for entry, td in upload.items():
            residual = state.get(entry) if self.error_feedback else None
            message[entry], residual, nbytes = compress_entry(self.compressor, td, residual, generator, self.flatten, self.error_feedback)
            if self.error_feedback:
                new_state[entry] = residual  # entries this round did not send keep their residual
            total += nbytes
        return Sent(message, new_state, total)


class CompressBroadcast(BroadcastStage):
    """The server compresses each entry of the broadcast once a round.

    With error feedback the clients hold a copy h of each entry (the first broadcast of an entry,
    e.g. the initial model, travels uncompressed); each round the server sends C(v - h) and both sides
    set h <- h + C(v - h), which the clients use as the entry: error feedback on the broadcast's
    increments, the residual being v - h (24.7; an unbiased C in its contractive form C / (1 + omega)).
    Without it the clients receive C(v).
    """

    order = COMPRESS
    name = "compress_down"

    def __init__(self, compressor: Compressor, error_feedback: bool = True, flatten: bool = False) -> None:
        self.compressor, self.error_feedback, self.flatten = compressor, error_feedback, flatten

    def apply(self, broadcast: Payload, state: NestedState, key: StageKey) -> Sent:
        generator = key.generator(DOWN_STREAM, _device(broadcast)) if self.compressor.randomized else None
        message, new_state, total = {}, dict(state), 0
        for entry, value in broadcast.items():
            held = state.get(entry) if self.error_feedback else None
            if held is not None:  # a resumed copy is loaded on the CPU
                held = {k: t.to(value[k].device) for k, t in held.items()}
            if self.error_feedback and held is None:
                message[entry] = new_state[entry] = P.detach_clone(value)
                total += P.num_bytes(value.values())
                continue
            change = value if held is None else P.sub(value, held)
            decoded, _, nbytes = compress_entry(self.compressor, change, None, generator, self.flatten, held is not None)
            message[entry] = decoded if held is None else P.add(held, decoded)
            if self.error_feedback:
                new_state[entry] = message[entry]
            total += nbytes
        return Sent(message, new_state, total)


@dataclass
class Compression:
    """Compression of the messages (``--model.compression.*``; docs/compression.md).

    Args:
        up: the compressor of every client upload (None: sent as it is), e.g. ``TopK``, ``RandomK``,
            ``QSGD``, ``ScaledSign``, ``Int8``, ``Cast`` (``fl_lightning.compression``).
        down: the compressor of the server's broadcast (None: sent as it is).
        error_feedback_up: keep each client's compression residual and add it to its next upload (24.6).
            None (default, "auto"): on for a biased compressor (TopK, RandomK unscaled, ScaledSign, Int8,
            Cast), off for an unbiased one (QSGD, RandomK with ``unbiased=True``), which error feedback
            would divide by 1 + omega; an explicit true with an unbiased compressor runs, with a warning
            stating that factor (``warn_feedback``).
        error_feedback_down: send the compressed change since what the clients hold (server-side
            error feedback, (24.7)); false compresses the broadcast's values themselves (the model
            itself: sensible for casts and int8 only). Default true for every compressor.
        flatten: compress each message entry as one flattened vector (k of top-k over the whole
            message) instead of tensor by tensor.
    """

    up: Compressor | None = None
    down: Compressor | None = None
    error_feedback_up: bool | None = None
    error_feedback_down: bool = True
    flatten: bool = False

    @property
    def feedback_up(self) -> bool:
        """Whether the uplink uses error feedback: ``error_feedback_up``, or its "auto" default resolved."""
        return self.up is not None and uplink_feedback(self.error_feedback_up, self.up)

    def stages(self) -> tuple[list[ClientStage], list[BroadcastStage]]:
        """The uplink and downlink stages this setting adds to the message pipeline."""
        up = [CompressUploads(self.up, self.feedback_up, self.flatten)] if self.up is not None else []
        down = [CompressBroadcast(self.down, self.error_feedback_down, self.flatten)] if self.down is not None else []
        return up, down

    def check_with_privacy(self) -> None:
        """Client-level privacy clips each upload to norm C before compression (clip -> compress ->
        noise): the compressed upload must stay within C, so the uplink compressor must never increase a
        norm and must not add a residual (error feedback would send u + e, of norm up to 2C)."""
        if self.up is None:
            return
        if not self.up.never_increases_norm:
            raise ValueError(
                f"compression.up={self.up.describe()} can increase an upload's norm beyond privacy's clip norm C, so the noise "
                "would not cover it; under privacy use TopK, RandomK (unbiased: false) or ScaledSign"
            )
        if self.feedback_up:
            raise ValueError(
                "compression.error_feedback_up must be false under privacy: the residual added to an upload would carry it "
                "beyond the clip norm C (the downlink may use error feedback)"
            )

    def check_shapes(self, shapes: dict[str, torch.Size]) -> None:
        """One line before training if a compressor cannot encode a model-shaped message."""
        for setting, compressor in (("compression.up", self.up), ("compression.down", self.down)):
            if compressor is not None:
                check_entry_sizes(compressor, shapes, self.flatten, setting)

    def warn_feedback(self, shapes: dict[str, torch.Size]) -> str | None:
        """An explicit ``error_feedback_up: true`` with an unbiased uplink compressor is logged (and
        returned): (24.6) sends it as C/(1 + omega), omega computed for the model's tensors (or the
        flattened message), each upload's step shrunk by that factor. Not refused, so that configs
        that relied on the former default (error feedback on for every compressor) still run."""
        if self.up is None or not self.up.unbiased or self.error_feedback_up is not True:
            return None
        sizes = {n: s.numel() for n, s in shapes.items()}
        factors = shrink_factors(self.up, {"the flattened message": sum(sizes.values())} if self.flatten else sizes)
        largest = max(factors, key=factors.__getitem__)
        if factors[largest] <= 1.0:
            return None
        top = f"{factors[largest]:.3g} for {largest}"
        spread = f"{min(factors.values()):.3g} to {top}" if len(factors) > 1 else top
        message = (
            f"compression.error_feedback_up is true with the unbiased {self.up.describe()}: error feedback sends it as "
            f"C/(1 + omega), 1 + omega = {spread}, so each upload's step is up to "
            f"{factors[largest]:.3g}x smaller; the default (error_feedback_up: null) sends unbiased uploads without error feedback"
        )
        log.warning(message)
        return message
