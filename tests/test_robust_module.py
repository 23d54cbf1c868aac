"""Robust aggregation in the round: a rule whose output is the weighted mean gives the plain run (so r stands
where the mean goes, SCAFFOLD's control deltas included); centered clipping's center resumes bit for bit; a round
whose dropouts leave too few clients for the rule is skipped with one warning."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import SCAFFOLD, FedAvg
from fl_lightning.compression import Compression, TopK
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.models import MLP
from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.robust import Robust
from tests.conftest import tiny_datamodule, tiny_trainer, assert_resumes_bitwise


def _module(algorithm, robust=None, faults=ClientFaults(), **kw):
    torch.manual_seed(0)
    return FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), algorithm, LocalTraining(lr=0.1, steps=3, batch_size=8),
                           faults=faults, robust=robust, **kw)  # fmt: skip


def _topk(feedback):
    return Compression(up=TopK(ratio=0.3), error_feedback_up=feedback)


def _fit(tmp_path, module, rounds, clients_per_round=5, ckpt_path=None, **kw):
    trainer = tiny_trainer(tmp_path, rounds, **kw)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=clients_per_round), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    "algorithm, extra",
    [
        (FedAvg, lambda: {}),
        (SCAFFOLD, lambda: {}),
        (SCAFFOLD, lambda: {"compression": _topk(True)}),  # the rule sees the decoded (sparse) uploads
        (FedAvg, lambda: {"privacy": ClientPrivacy(clip_norm=0.5, noise_multiplier=1.0), "compression": _topk(False)}),  # clip, compress, rule, noise
    ],
    ids=["fedavg", "scaffold", "scaffold-topk-ef", "fedavg-dp-topk"],
)
def test_a_rule_that_returns_the_mean_gives_the_plain_run(tmp_path, algorithm, extra):
    plain, bound = _module(algorithm(), **extra()), _module(algorithm(), Robust("norm_bound", max_norm=1e9), **extra())
    _fit(tmp_path / "a", plain, 3)
    trainer = _fit(tmp_path / "b", bound, 3)
    for a, b in zip(plain.model.parameters(), bound.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, state in plain.server_state.items():  # SCAFFOLD's c = mean_i c_i
        for k in state:
            torch.testing.assert_close(state[k], bound.server_state[name][k], rtol=1e-5, atol=1e-6)
    assert "robust/upload_norm_mean" in trainer.callback_metrics
    assert not torch.equal(next(plain.model.parameters()), next(_module(algorithm()).model.parameters()))  # it trained


@pytest.mark.parametrize("robust", [dict(rule="centered_clipping", tau=0.05, iters=2), dict(rule="fltrust", root_size=30)])
def test_stateful_rules_resume_bitwise(tmp_path, robust):
    """Centered clipping's center is checkpointed; FLTrust's root data is redrawn from the seed (the same samples)."""

    def run(path, rounds, ckpt=None):
        module = _module(SCAFFOLD(), Robust(**robust))
        checkpoint = ModelCheckpoint(dirpath=path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        _fit(path, module, rounds, ckpt_path=ckpt, enable_checkpointing=True, callbacks=[checkpoint])
        return module

    straight, resumed = assert_resumes_bitwise(run, tmp_path)
    if robust["rule"] == "centered_clipping":
        assert torch.equal(straight.robust.rule_impl.center, resumed.robust.rule_impl.center)
        assert float(torch.linalg.vector_norm(straight.robust.rule_impl.center)) > 0
    else:
        root = [m.rounds.stage("robust").root_data.samples for m in (straight, resumed)]
        assert all(torch.equal(a, b) for a, b in zip(*root))
        assert len(root[0][0]) == 30


def test_too_few_reporting_clients_skip_the_round_with_a_warning(tmp_path, caplog):
    module = _module(FedAvg(), Robust("krum", f=1), faults=ClientFaults(dropout=0.3))  # krum needs n >= 5 of the 5
    before = [p.detach().clone() for p in module.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="fl_lightning.engine.module"):
        _fit(tmp_path, module, 3)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped and all("robust.rule=krum needs n > 2f + 2: got n=" in s for s in skipped)
    dropped = [r for r in caplog.records if "dropped out" in r.getMessage()]
    assert dropped and len(skipped) == len({r.getMessage().split(":")[0] for r in dropped})  # one per round with a dropout
    if len(skipped) == 3:
        assert all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


def test_a_cohort_too_small_for_the_rule_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"^robust.rule=bulyan needs n >= 4f \+ 3: got n=5 reporting clients and f=1 \(clients per round\)$"):
        _fit(tmp_path, _module(FedAvg(), Robust("bulyan", f=1)), 1)


def test_multi_krum_with_privacy_and_error_feedback_compression_is_refused_first_for_robustness():
    """The combined run (Multi-Krum + top-k with error feedback + client-level DP): robust's reason comes first."""
    with pytest.raises(ValueError, match=r"^robust.rule=multi_krum with privacy: client-level DP's noise covers one client moving the sum"):
        _module(FedAvg(), Robust("multi_krum", f=1), privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0), compression=_topk(True))


def test_the_kept_record_drops_rounds_past_a_resumed_checkpoint(tmp_path):
    from fl_lightning.robust.record import KeptRecord

    record = KeptRecord(str(tmp_path))
    record.start(0)
    for r in range(4):
        record.add(r, [r, r + 5])
    KeptRecord(str(tmp_path)).start(2)  # resumed from round 2's checkpoint: rounds 2 and 3 are rerun
    record.add(2, [7])
    assert record.rows() == [(0, [0, 5]), (1, [1, 6]), (2, [7])]
    KeptRecord(str(tmp_path)).start(0)  # a new run in the same folder starts empty
    assert record.rows() == []


def test_a_selecting_rule_is_scored_as_a_detector_of_the_known_attackers(tmp_path):
    """Multi-Krum with f=1 against one sign-flipping attacker among 5 reporting clients: kept and excluded uploads
    counted by kind, precision and recall from them; the malicious ids are written beside the metrics."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from fl_lightning.adversary import Attack, SignFlip

    module = _module(FedAvg(), Robust("multi_krum", f=1), attack=Attack(clients=[2], upload=SignFlip(scale=50.0)))
    _fit(tmp_path, module, 3, clients_per_round=8, logger=CSVLogger(tmp_path, name="run"))
    run = tmp_path / "run" / "version_0"
    assert (run / "malicious_clients.csv").read_text() == "client\n2\n"
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("robust/kept_benign")]
    kept = {int(r["round"]): [int(c) for c in r["kept"].split()] for r in csv.DictReader(open(run / "robust_kept.csv"))}
    assert len(rows) == 3 and sorted(kept) == [0, 1, 2]
    for row in rows:
        ids = kept[int(float(row["round"]))]
        assert float(row["robust/kept_malicious"]) == (2 in ids) and float(row["robust/kept_benign"]) == len(ids) - (2 in ids)
        assert float(row["robust/detection_recall"]) == (2 not in ids)  # one attacker per round (all 8 clients report)
        assert float(row["robust/detection_precision"]) == (2 not in ids)  # multi_krum excludes exactly f = 1


def test_a_rule_that_keeps_every_upload_writes_no_kept_record(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    _fit(tmp_path, _module(FedAvg(), Robust("median")), 1, logger=CSVLogger(tmp_path, name="run"))
    assert (tmp_path / "run" / "version_0" / "metrics.csv").exists() and not (tmp_path / "run" / "version_0" / "robust_kept.csv").exists()
