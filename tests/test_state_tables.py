"""Client state as stacked tables: ``gather``/``scatter`` against a plain dict of clients, checkpoint round
trips of both stores, the flat checkpoint format, and batched rounds that read and write the tables in one call."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.core.errors import StoreError
from fl_lightning.core.state import ClientStore, DiskClientStore
from fl_lightning.rounds.round_states import RoundStates
from fl_lightning.executors import BatchedExecutor
from models import MLP
from tests.conftest import assert_resumes_bitwise, tiny_datamodule, tiny_trainer

SHAPES = {"w": (3, 2), "b": (3,)}


def _init():
    return {"c": {k: torch.full(s, -1.0, dtype=torch.float64) for k, s in SHAPES.items()}, "n": {"k": torch.tensor(0)}}


def _reference_gather(reference, ids):
    """The plain-dict store: each client's own state or the initial one, stacked with torch.stack."""
    states = [reference.get(c, _init()) for c in ids]
    return {n: {k: torch.stack([s[n][k] for s in states]) for k in td} for n, td in _init().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].keys() == b[n].keys()
        for k in a[n]:
            assert a[n][k].dtype == b[n][k].dtype and torch.equal(a[n][k], b[n][k])


def test_gather_and_scatter_match_a_dict_of_clients_across_rounds_and_growth():
    store, reference, generator = ClientStore(), {}, torch.Generator().manual_seed(0)
    for round_idx in range(12):  # rows grow past every capacity (1, 2, 4, ...) as new clients appear
        ids = torch.randint(0, 40, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
        _assert_same(store.gather(ids, _init), _reference_gather(reference, ids.tolist()))
        new = {
            "c": {k: torch.randn(len(ids), *s, dtype=torch.float64, generator=generator) for k, s in SHAPES.items()},
            "n": {"k": torch.full((len(ids),), round_idx)},
        }
        store.scatter(ids, new)
        for i, cid in enumerate(ids.tolist()):  # a repeated id: its last row, as put after put
            reference[cid] = {n: {k: v[i].clone() for k, v in td.items()} for n, td in new.items()}
    assert store.client_ids() == sorted(reference) and len(store) == len(reference)
    for cid, state in reference.items():
        _assert_same(store.get(cid, dict), state)
        assert cid in store
    assert 1000 not in store and store.get(1000, lambda: {"x": {}}) == {"x": {}}


def test_put_replaces_the_whole_state_and_get_returns_copies():
    store = ClientStore()
    store.put(3, {"a": {"p": torch.ones(2)}, "b": {"q": torch.zeros(1)}})
    store.put(3, {"a": {"p": torch.full((2,), 2.0)}})  # b is no longer the client's
    got = store.get(3, dict)
    assert got.keys() == {"a"} and torch.equal(got["a"]["p"], torch.full((2,), 2.0))
    got["a"]["p"].add_(5)  # a copy: the table is unchanged
    assert torch.equal(store.get(3, dict)["a"]["p"], torch.full((2,), 2.0))
    gathered = store.gather(torch.tensor([3, 7]), lambda: {"b": {"q": torch.full((1,), 9.0)}})
    assert torch.equal(gathered["b"]["q"], torch.tensor([[9.0], [9.0]]))  # client 3 holds no b: the initial value
    store.put(4, {"a": {"p": torch.ones(5)}})  # a shape its table does not have: kept beside the tables
    assert torch.equal(store.get(4, dict)["a"]["p"], torch.ones(5)) and torch.equal(store.get(3, dict)["a"]["p"], torch.full((2,), 2.0))
    with pytest.raises(StoreError, match=r"^client state a/p is stored as \(2,\) torch.float32, its initial value is \(3,\)"):
        store.gather(torch.tensor([3]), lambda: {"a": {"p": torch.ones(3)}})


def _filled(store):
    generator = torch.Generator().manual_seed(1)
    for cid in (5, 0, 17, 2):
        store.put(cid, {"c": {"w": torch.randn(3, 2, generator=generator)}, "personal": {"v": torch.randn(4, generator=generator).half()}})
    return store


def test_memory_store_checkpoint_round_trip_is_bitwise_and_keeps_the_flat_format():
    store = _filled(ClientStore())
    flat = store.checkpoint_state(3)
    assert list(flat) == [f"{c}/{n}" for c in (5, 0, 17, 2) for n in ("c/w", "personal/v")]  # clients in order of first put
    loaded = ClientStore()
    loaded.load_checkpoint_state(flat)
    assert loaded.equal(store) and list(loaded.state_dict()) == list(flat)
    assert all(torch.equal(loaded.state_dict()[k], v) and loaded.state_dict()[k].dtype == v.dtype for k, v in flat.items())


def test_a_checkpoint_written_by_the_dict_store_loads():
    """The mapping the store wrote before tables (``{"<client>/<state>/<param>": tensor}``, one dict per client)."""
    old = {"9/c/w": torch.arange(6.0).reshape(3, 2), "9/personal/v": torch.ones(4), "1/c/w": torch.zeros(3, 2)}
    store = ClientStore()
    store.load_checkpoint_state(old)
    assert store.client_ids() == [1, 9]
    _assert_same(store.get(9, dict), {"c": {"w": old["9/c/w"]}, "personal": {"v": old["9/personal/v"]}})
    _assert_same(store.get(1, dict), {"c": {"w": old["1/c/w"]}})
    assert store.state_dict().keys() == old.keys()


def test_disk_store_gathers_scatters_and_round_trips_its_snapshot(tmp_path):
    disk, memory = _filled(DiskClientStore(str(tmp_path / "a"))), _filled(ClientStore())
    ids = torch.tensor([17, 3, 5])
    init = lambda: {"c": {"w": torch.zeros(3, 2)}}  # noqa: E731
    _assert_same(disk.gather(ids, init), memory.gather(ids, init))
    new = {"c": {"w": torch.randn(3, 3, 2)}}
    disk.scatter(ids, new), memory.scatter(ids, new)
    assert disk.equal(memory)
    reference = disk.checkpoint_state(7)
    restored = DiskClientStore(str(tmp_path / "b"))
    restored.load_checkpoint_state(reference)
    assert restored.equal(memory)
    restored.close(), disk.close()


def _scaffold_run(directory, rounds, ckpt_path=None):
    torch.manual_seed(0)
    module = FederatedModule(
        MLP(in_features=8, num_classes=3, hidden=[16]), SCAFFOLD(), LocalTraining(lr=0.1, steps=3, batch_size=8), execution=BatchedExecutor()
    )
    checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=3), ckpt_path=ckpt_path)
    return module


def test_batched_scaffold_reads_the_tables_in_one_call_and_resumes_bitwise(tmp_path, monkeypatch):
    calls = {"gather": [], "scatter": []}
    gather, scatter = ClientStore.gather, ClientStore.scatter
    monkeypatch.setattr(ClientStore, "gather", lambda self, ids, init: calls["gather"].append(len(ids)) or gather(self, ids, init))
    monkeypatch.setattr(ClientStore, "scatter", lambda self, ids, s: calls["scatter"].append(len(ids)) or scatter(self, ids, s))
    monkeypatch.setattr(FederatedModule, "client_state", lambda *a: pytest.fail("a batched round loaded a client's state by itself"))
    straight, _ = assert_resumes_bitwise(_scaffold_run, tmp_path, min_clients=4)
    assert not straight.executor.inner.fallbacks
    assert calls["gather"] == [3] * 8  # one per round: 4 + 2 + 2 rounds
    assert calls["scatter"].count(3) == 8 and set(calls["scatter"]) == {1, 3}  # and a resume's loading, client by client


def test_batched_rounds_equal_loading_client_by_client(tmp_path, monkeypatch):
    tables = _scaffold_run(tmp_path / "t", 3)
    monkeypatch.setattr(RoundStates, "gather", lambda self, ids: None)  # each task's own load_state, stacked
    one_by_one = _scaffold_run(tmp_path / "o", 3)
    assert tables.store.equal(one_by_one.store) and len(tables.store) > 0
    for a, b in zip(tables.model.parameters(), one_by_one.model.parameters()):
        assert torch.equal(a, b)


def test_new_states_that_are_rows_of_one_tensor_are_scattered_without_stacking_them_again():
    from fl_lightning.rounds.round_states import _stacked

    base = torch.randn(4, 3, 2)
    rows = list(base.unbind(0))
    assert torch.equal(_stacked(rows), base) and _stacked(rows).data_ptr() == base.data_ptr()
    shuffled = [rows[2], rows[0], rows[3]]
    assert torch.equal(_stacked(shuffled), torch.stack(shuffled))
    columns = list(base.unbind(2))  # strided views, not rows
    assert torch.equal(_stacked(columns), torch.stack(columns))
