"""Every client's accuracy at every evaluation (fl_lightning/engine/client_record.py): ``clients.csv`` has one row per
client, split and evaluation, its accuracies give back the logged summaries (mean, weighted, worst and best 10 %,
variance, share below each threshold) when recomputed by hand, and a resume continues the file."""

from __future__ import annotations

import csv
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import FedSim
from fl_lightning.engine.client_record import COLUMNS, FILE
from fl_lightning.engine.personal_eval import PersonalizedEvaluation
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer


def _fit(tmp_path, rounds, ckpt_path=None):
    data = tiny_datamodule(num_clients=6, holdout_fraction=0.4, new_client_fraction=0.34)
    torch.manual_seed(0)  # a personal head: each client's own model differs from the global one
    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), FedSim(), LocalTraining(lr=0.1, steps=3, batch_size=8),
                             personal=["net.3.*"])  # fmt: skip
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=2, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, logger=CSVLogger(tmp_path, name="run", version=0), enable_checkpointing=True,
                           callbacks=[checkpoint, PersonalizedEvaluation(below=[0.75, 0.5])], limit_val_batches=None,
                           val_check_interval=1, check_val_every_n_epoch=None)  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, module, data


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _reference(accs: np.ndarray, sizes: np.ndarray) -> dict[str, float]:
    """The summaries from the clients' accuracies, in float64 numpy."""
    ordered, k = np.sort(accs), max(1, math.ceil(0.1 * len(accs)))
    return {"acc_mean": accs.mean(), "acc_weighted": (accs * sizes).sum() / sizes.sum(), "acc_worst10": ordered[:k].mean(),
            "acc_best10": ordered[-k:].mean(), "acc_var": np.var(accs), "acc_below50": np.mean(accs < 0.5),
            "acc_below75": np.mean(accs < 0.75)}  # fmt: skip


def test_every_client_at_every_evaluation_recomputes_the_logged_summaries_and_a_resume_continues_the_record(tmp_path):
    run = tmp_path / "run" / "version_0"
    _fit(tmp_path, 3)
    before = _read(run / FILE)
    trainer, module, data = _fit(tmp_path, 5, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # from round 2's checkpoint
    trainer.test(module, datamodule=data, verbose=False)
    rows = _read(run / FILE)
    assert list(rows[0]) == list(COLUMNS)

    # one row per client per evaluation per split: rounds 0-1 kept from the first fit, round 2 (after its checkpoint)
    # dropped and logged again by the resumed fit, bitwise the same; the test appended
    unseen = set(data.unseen_clients)
    for split, part, rounds in (("val", "validation", range(5)), ("test", "test", [4])):
        clients = [c for c in sorted(set(range(data.num_clients)) | unseen) if len(data.client_holdout_part(c, part))]
        assert [(int(r["round"]), int(r["client"])) for r in rows if r["split"] == split] == [(t, c) for t in rounds for c in clients]
    assert [r for r in rows if int(r["round"]) < 3 and r["split"] == "val"] == [r for r in before if int(r["round"]) < 3]
    assert {r["seen"] for r in rows if int(r["client"]) in unseen} == {"0"} and unseen
    assert any(r["global_acc"] != r["personal_acc"] for r in rows if r["seen"] == "1")

    # the accuracies themselves: a plain forward of the global model, and of each client's own head, on its test half
    module.eval()
    for r in (r for r in rows if r["split"] == "test"):
        inputs, target = data.client_holdout_batch(int(r["client"]), "test")
        with torch.no_grad():
            assert float(r["global_acc"]) == (module.model(inputs).argmax(-1) == target).double().mean().item()
            if r["seen"] == "1":
                own = {**dict(module.model.named_parameters()), **module.client_personal(int(r["client"]))}
                logits = torch.func.functional_call(module.model, own, (inputs,))
                assert float(r["personal_acc"]) == (logits.argmax(-1) == target).double().mean().item()
        assert int(r["samples"]) == len(target)

    # the logged summaries of every evaluation, recomputed from the file (logged as float32)
    groups = defaultdict(list)
    for r in rows:
        groups[(int(r["round"]), r["split"], "personal" if r["seen"] == "1" else "unseen")].append(r)
    metrics = _read(run / "metrics.csv")
    checked = 0
    for (round_, split, who), group in groups.items():
        logged = next(m for m in metrics if m.get(f"{split}/{who}_acc_mean") and float(m["round"]) == round_)
        accs = np.array([float(r["personal_acc"]) for r in group])
        for name, value in _reference(accs, np.array([float(r["samples"]) for r in group])).items():
            assert float(logged[f"{split}/{who}_{name}"]) == float(np.float32(value)), (round_, split, who, name)
            checked += 1
    assert checked == 6 * 7 * 2
    assert {float(m["val/personal_acc_below75"]) for m in metrics if m.get("val/personal_acc_below75")} - {0.0, 1.0}  # not trivially


@pytest.mark.parametrize("below", [1.0, 0, [0.5, 1.5], [0.5, -0.1], "half"])
def test_a_threshold_outside_0_1_is_refused(below):
    with pytest.raises(ValueError, match=r"PersonalizedEvaluation.below must be accuracies in \(0, 1\), got"):
        PersonalizedEvaluation(below=below)


def test_the_tables_mark_the_lowest_share_below_a_threshold_as_the_best():
    from fl_lightning.experiments.history import History
    from fl_lightning.experiments.tables import summary_tables

    def run(acc, share):
        return History([{"val/acc": acc, "test/personal_acc_below50": share, "round": 1.0}])

    (table,) = summary_tables({"A": [run(0.9, 0.1), run(0.91, 0.12)], "B": [run(0.5, 0.6), run(0.52, 0.62)]}, [0, 1], [])
    share = next(row for row in table.rows if row[0].startswith("Share of clients below 50% accuracy at test (client holdout, test half)"))
    assert share[1:] == ["**11.0 ± 1.4**", "61.0 ± 1.4"]  # fewer clients below is better
    assert table.rows[0][1:] == ["**90.5 ± 0.7**", "51.0 ± 1.4"]
