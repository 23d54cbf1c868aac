"""DiskClientStore: same results as the in-memory store, exact resume, nothing resident."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.state import DiskClientStore
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.test_resume import StatefulFedAvg


def _run(tmp_path, rounds, store=None, ckpt_dir=None, ckpt_path=None):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), StatefulFedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), store=store)
    kw = {}
    if ckpt_dir is not None:
        kw = dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0)])
    tiny_trainer(tmp_path, rounds, **kw).fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=ckpt_path)
    return module


def test_disk_store_matches_memory_store_and_holds_nothing_in_memory(tmp_path):
    memory = _run(tmp_path, 4)
    disk = _run(tmp_path, 4, store=DiskClientStore(str(tmp_path / "store")))
    assert disk.store._states == {}, "client tensors must live on disk only"
    assert len(list((tmp_path / "store" / "live").glob("*.safetensors"))) == len(memory.store) > 0
    assert memory.store.equal(disk.store)
    for a, b in zip(memory.model.parameters(), disk.model.parameters()):
        assert torch.equal(a, b)


def test_disk_store_resume_restores_the_checkpoint_snapshot(tmp_path):
    straight = _run(tmp_path / "a", 6, store=DiskClientStore(str(tmp_path / "a" / "store")))
    _run(tmp_path / "b", 3, store=DiskClientStore(str(tmp_path / "b" / "store")), ckpt_dir=tmp_path / "b" / "ckpt")
    resumed = _run(
        tmp_path / "c", 6, store=DiskClientStore(str(tmp_path / "c" / "store")), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt")
    )
    assert straight.store.equal(resumed.store)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_disk_store_refuses_a_directory_holding_another_runs_states(tmp_path):
    store = DiskClientStore(str(tmp_path))
    store.put(0, {"c": {"w": torch.ones(2)}})
    with pytest.raises(ValueError, match="already holds client states"):
        DiskClientStore(str(tmp_path))
