"""Attacks from the command line: the backdoor config logs attack/backdoor_asr, which equals the share of
triggered test images (of other classes) the saved model predicts as the target, recomputed here; the
label-flipping config logs the uploads' norms; bad settings stop before training with one line, exit 2."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from datamodules.sources import load_source
from models import SmallCNN
from tests.test_cli import ROOT, assert_refused_in_one_line, run_fl_lightning

SMALL = ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false",
         "--trainer.callbacks.init_args.every_n_train_steps", "3"]  # fmt: skip


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_backdoor_config_logs_the_attack_success_rate_of_its_model(tmp_path):
    proc = run_fl_lightning("fit", "--config", str(ROOT / "configs" / "attack_backdoor_digits.yaml"), *SMALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "attack_backdoor_digits" / "version_0"
    rows = _rows(run / "metrics.csv")
    asr = [float(r["attack/backdoor_asr"]) for r in rows if r.get("attack/backdoor_asr")]
    assert len(asr) == 2  # the evaluation after round 3 and the test of the final model
    assert all(r["attack/malicious_clients"] for r in rows if r.get("train/loss"))
    assert any(float(r["attack/norm_malicious"] or 0) > 0 for r in rows)
    model = SmallCNN(in_channels=1, num_classes=10, image_size=8)
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    model.load_state_dict({k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")})
    test = load_source("digits").test.tensors
    x, y = test[0].numpy().copy(), test[1].numpy()
    x = x[y != 0]
    x[..., -2:, -2:] = 1.0  # the 2x2 white corner of the config
    with torch.no_grad():
        predicted = model(torch.tensor(x)).argmax(-1).numpy()
    assert asr[-1] == pytest.approx(float(np.mean(predicted == 0)), abs=1e-6)


def test_the_label_flip_config_logs_the_norms_of_benign_and_malicious_uploads(tmp_path):
    args = [*SMALL, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--model.local.steps", "2",
            "--data.init_args.participation.init_args.clients_per_round", "20"]  # fmt: skip
    proc = run_fl_lightning("fit", "--config", str(ROOT / "configs" / "attack_label_flip_digits.yaml"), *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _rows(tmp_path / "runs" / "attack_label_flip_digits" / "version_0" / "metrics.csv") if r.get("train/loss")]
    assert [float(r["attack/malicious_clients"]) for r in rows] == [4.0] * 2  # every client each round: 20 % of 20
    assert all(float(r["attack/norm_benign"]) > 0 and float(r["attack/norm_malicious"]) > 0 for r in rows)
    assert "attack/backdoor_asr" not in rows[0]


def test_a_bad_attack_setting_exits_2_with_one_line(tmp_path):
    """(The refusals when training starts, e.g. an upload attack on FedProto, are test_attacks.py's.)"""
    args = [*SMALL, "--model.attack.init_args.fraction", "1.0"]
    proc = run_fl_lightning("fit", "--config", str(ROOT / "configs" / "attack_label_flip_digits.yaml"), *args, cwd=tmp_path)
    assert_refused_in_one_line(proc, "attack.fraction must be in [0, 1), got 1.0", tmp_path / "runs" / "attack_label_flip_digits" / "version_0")
