"""Attacks compose with the message pipeline (docs/robustness.md, "Attacks"): the attacker's upload is what
compression encodes (with error feedback, the malicious client keeps the residual of its crafted upload) and
what client-level DP clips (so the clip bounds a boosted upload)."""

from __future__ import annotations

import math

import torch

from datamodules import IID, FederatedDataModule
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.adversary import Attack, GaussianUpload, ModelReplacement
from fl_lightning.adversary.gaussian import GAUSSIAN_STREAM
from fl_lightning.compression import TopK
from fl_lightning.compression.stages import Compression
from fl_lightning.core.participation import derive_seed
from fl_lightning.pipeline.privacy import ClientPrivacy, upload_norm
from models import MLP
from tests.conftest import tiny_trainer

MALICIOUS = 2


def _fit(tmp_path, attack, rounds=1, **kw):
    torch.manual_seed(0)
    module = FederatedModule(MLP(64, 10, hidden=[8]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), attack=attack, **kw)
    seen = []
    sum_uploads, aggregate = module.algorithm.upload_sum, module.algorithm.aggregate
    module.algorithm.upload_sum = lambda x, uploads, *a: (seen.append(list(uploads)), sum_uploads(x, uploads, *a))[1]
    module.algorithm.aggregate = lambda x, uploads, *a: (seen.append(list(uploads)), aggregate(x, uploads, *a))[1]
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
