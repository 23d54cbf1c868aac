"""Personal settings that would do nothing are refused in one line before training: a ``personal`` pattern
that matches no parameter (it ran plain FedAvg and exited 0), a ``local.personal_lr`` no rule reads (APFL and
FedProto ran bitwise the same without it), a negative ``personalize_steps``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import APFL, Ditto, FedAvg, FedAvgP, FedProto, PFedMe
from fl_lightning.models import MLP

ROOT = Path(__file__).resolve().parents[1]


def _module(algorithm, personal=None, **local):
    return FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), algorithm, LocalTraining(steps=2, batch_size=8, **local), personal=personal)


def test_a_personal_pattern_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match=r"model.personal pattern 'no_such_layer\.\*' matches no trainable parameter of MLP \("):
        _module(FedAvgP(), personal=["no_such_layer.*"])


@pytest.mark.parametrize("algorithm", [APFL, FedProto, FedAvg])
def test_a_personal_lr_no_rule_reads_is_refused(algorithm):
    with pytest.raises(ValueError, match=rf"local.personal_lr=0.01 is read by no part of this run: {algorithm.__name__} has no personal"):
        _module(algorithm(), personal_lr=0.01)


@pytest.mark.parametrize("algorithm, personal", [(Ditto, None), (PFedMe, None), (FedAvgP, ["net.3.*"])])
def test_a_personal_lr_that_is_read_is_accepted(algorithm, personal):
    assert _module(algorithm(), personal=personal, personal_lr=0.01).local.personal_lr == 0.01


def test_a_negative_personalize_steps_is_refused():
    class Adapting(FedAvg):
        personalize_steps = -1

    with pytest.raises(ValueError, match=r"Adapting.personalize_steps must be an integer >= 0 .*got -1"):
        _module(Adapting())


def test_the_cli_refuses_the_glob_in_one_line_with_exit_2(tmp_path):
    cli = str(Path(sys.executable).with_name("fl-lightning"))
    proc = subprocess.run([cli, "fit", "--config", "pfl_fedper_digits", "--model.personal", "[no_such_layer.*]"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and "model.personal pattern 'no_such_layer.*' matches no trainable parameter" in proc.stderr
