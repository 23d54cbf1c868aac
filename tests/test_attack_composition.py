"""Attacks compose with the message pipeline (docs/robustness.md, "Attacks"): the attacker's upload is what
compression encodes (with error feedback, the malicious client keeps the residual of its crafted upload) and
what client-level DP clips (so the clip bounds a boosted upload)."""

from __future__ import annotations

import math

import torch

from datamodules import IID, FederatedDataModule
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.adversary import Attack, GaussianUpload, ModelReplacement, SignFlip
from fl_lightning.adversary.gaussian import GAUSSIAN_STREAM
from fl_lightning.compression import TopK
from fl_lightning.compression.stages import Compression
from fl_lightning.core.participation import derive_seed
from fl_lightning.pipeline.privacy import ClientPrivacy, upload_norm
from fl_lightning.reliability.faults import ClientFaults
from models import MLP
from tests.conftest import tiny_trainer

MALICIOUS = 2


def _fit(tmp_path, attack, rounds=1, **kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(64, 10, hidden=[8]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), attack=attack, **kw)
    seen = []
    name = "upload_sum" if "privacy" in kw else "aggregate"  # where the server receives the uploads
    receive = getattr(module.algorithm, name)
    setattr(module.algorithm, name, lambda x, uploads, *a: (seen.append(list(uploads)), receive(x, uploads, *a))[1])
    data = FederatedDataModule("digits", num_clients=4, partition=IID(), participation=UniformSampling(4), seed=1)
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=data)
    return module, seen


def test_compression_encodes_the_crafted_upload_and_error_feedback_keeps_its_residual(tmp_path):
    compression = Compression(up=TopK(ratio=0.25), error_feedback_up=True)
    module, seen = _fit(tmp_path, Attack(clients=[MALICIOUS], upload=GaussianUpload(0.5)), compression=compression)
    received = seen[0][MALICIOUS]["delta"]  # round 0: every client reports, in id order; no residual yet
    generator = torch.Generator().manual_seed(derive_seed(derive_seed(1, 0, MALICIOUS), GAUSSIAN_STREAM))
    z = 0.5 * torch.randn(sum(t.numel() for t in received.values()), generator=generator, dtype=torch.float64)
    residual = module.store.get(MALICIOUS, dict)["msg:compress:delta"]
    at = 0
    for name, sent in received.items():
        crafted = z[at : at + sent.numel()].view(sent.shape).float()
        at += sent.numel()
        kept = torch.zeros(sent.numel(), dtype=torch.bool)
        kept[torch.topk(crafted.reshape(-1).abs(), math.ceil(0.25 * sent.numel())).indices] = True
        torch.testing.assert_close(sent.reshape(-1), torch.where(kept, crafted.reshape(-1), 0.0))
        torch.testing.assert_close(residual[name], crafted - sent)


def test_client_level_dp_clips_the_boosted_upload(tmp_path):
    privacy = ClientPrivacy(clip_norm=0.05, noise_multiplier=0.0, delta=1e-3)
    module, seen = _fit(tmp_path, Attack(clients=[MALICIOUS], upload=ModelReplacement(gamma=50.0)), privacy=privacy)
    assert float(module.trainer.callback_metrics["attack/norm_malicious"]) > 1.0  # what the attacker crafted, before the clip
    assert upload_norm(seen[0][MALICIOUS]) <= 0.05 * (1 + 1e-6)  # what the server sums


class RecordingSignFlip(SignFlip):
    def __init__(self):
        super().__init__()
        self.views = []

    def craft(self, own, benign, view):
        self.views.append((view, own.shape[0], benign.shape[0]))
        return super().craft(own, benign, view)


def test_with_dropouts_n_and_f_count_the_clients_that_reported(tmp_path):
    upload = RecordingSignFlip()
    module, seen = _fit(tmp_path, Attack(clients=[0, 1, 2], upload=upload), rounds=4, faults=ClientFaults(dropout=0.4))
    assert len(upload.views) == len(seen) and any(len(s) < 4 for s in seen)  # some rounds lost clients
    for (view, f, b), uploads in zip(upload.views, seen):
        assert view.reporting == len(uploads) == f + b and view.malicious == f
