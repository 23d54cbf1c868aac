"""TargetAccuracy records the first round a target is reached, keeps it in checkpoints and
can stop the run; PerClientEvaluation logs per-client accuracy of the global model."""

import csv

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from fl_lightning.engine.callbacks import PerClientEvaluation, TargetAccuracy, target_key
from fl_lightning.core.objective import Objective
from fl_lightning.experiments.history import History
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


def fit(tmp_path, callbacks, rounds=6, **kw):
    module, data = tiny_module(seed=0), tiny_datamodule(**kw)
    trainer = tiny_trainer(
        tmp_path, rounds, callbacks=callbacks, limit_val_batches=None, val_check_interval=1,
        check_val_every_n_epoch=None, logger=CSVLogger(tmp_path, name="", version="log"), log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return trainer, module, data


def test_target_callback_records_first_round_and_stops_at_the_last_target(tmp_path):
    trainer, _, _ = fit(tmp_path / "full", [])
    accs = History.from_csv(tmp_path / "full" / "log" / "metrics.csv").series("val/acc")
    rounds, values = accs[0].tolist(), accs[2].tolist()
    assert rounds == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    low, high = min(values), values[2]  # the accuracy after round 3 is reached by round 3 at the latest
    first = {t: int(next(r for r, v in zip(rounds, values) if v >= t)) for t in (low, high)}
    assert first[high] <= 3

    target = TargetAccuracy([high, low], stop=True)
    trainer, module, _ = fit(tmp_path / "stop", [target])
    assert target.reached == first
    assert trainer.global_step == first[high] < 6  # stopped at the evaluation reaching the last target
    logged = History.from_csv(tmp_path / "stop" / "log" / "metrics.csv")
    assert logged.series(target_key(high))[2].tolist() == [float(first[high])]
    assert logged.series(target_key(high))[0].tolist() == [float(first[high])]

    ckpt = tmp_path / "stop.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"][target.state_key]
    restored = TargetAccuracy([low, high])
    restored.load_state_dict(state)
    assert restored.reached == first


def test_target_callback_rejects_bad_targets_and_unlogged_monitors(tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        TargetAccuracy([])
    with pytest.raises(ValueError, match="distinct"):
        TargetAccuracy([0.5, 0.5])
    with pytest.raises(ValueError, match="monitor='val/nope' is not logged"):
        fit(tmp_path, [TargetAccuracy([0.5], monitor="val/nope")], rounds=1)


def test_per_client_evaluation_logs_mean_worst_and_std_of_client_accuracies(tmp_path):
    trainer, module, data = fit(tmp_path, [PerClientEvaluation()], rounds=2, num_clients=12, holdout_fraction=0.3)
    with open(tmp_path / "log" / "per_client_acc.csv") as f:
        table = [r for r in csv.DictReader(f) if r["round"] == "2"]
    assert [int(r["client"]) for r in table] == list(range(12))
    # recompute the last evaluation's per-client accuracies from the final model
    module.eval()
    with torch.no_grad():
        for r in table:
            _, logits, target = Objective(module.model)(data.client_holdout_batch(int(r["client"])))
            assert int(r["samples"]) == len(target) == len(data.client_holdout[int(r["client"])]) > 0
            assert int(r["correct"]) == int((logits.argmax(-1) == target).sum())
    acc = torch.tensor([float(r["acc"]) for r in table], dtype=torch.float64)
    history = History.from_csv(tmp_path / "log" / "metrics.csv")
    last = history.records[-1]
    assert last["clients/acc_mean"] == pytest.approx(float(acc.mean()), abs=1e-6)
    assert last["clients/acc_worst10"] == pytest.approx(float(acc.sort().values[:2].mean()), abs=1e-6)  # ceil(1.2)
    assert last["clients/acc_std"] == pytest.approx(float(acc.std(unbiased=False)), abs=1e-6)


def test_per_client_evaluation_needs_held_out_data(tmp_path):
    with pytest.raises(ValueError, match="holdout_fraction in \\(0, 1\\)"):
        fit(tmp_path, [PerClientEvaluation()], rounds=1)


def test_per_client_table_goes_to_wandb_as_a_table_and_elsewhere_to_csv(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.loggers import WandbLogger

    wandb = WandbLogger(offline=True, save_dir=str(tmp_path))
    tables = []
    monkeypatch.setattr(wandb, "log_table", lambda **kw: tables.append(kw))
    csv_logger = CSVLogger(tmp_path, name="", version="csv")
    trainer = SimpleNamespace(global_rank=0, loggers=[wandb, csv_logger], default_root_dir=str(tmp_path))
    PerClientEvaluation()._write_table(trainer, [[2, 0, 10, 7, 0.7]])
    assert tables == [{"key": "clients/acc_table", "columns": ["round", "client", "samples", "correct", "acc"], "data": [[2, 0, 10, 7, 0.7]]}]
    assert (tmp_path / "csv" / "per_client_acc.csv").read_text().splitlines() == ["round,client,samples,correct,acc", "2,0,10,7,0.7"]
