"""DiskClientStore: same results as the in-memory store, exact resume, nothing resident;
it owns its folder (lock, run id), keeps every snapshot a retained checkpoint references,
and detects damaged files."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.core.errors import CheckpointError, FLError, StoreError
from fl_lightning.core.state import DiskClientStore
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.test_resume import StatefulFedAvg


def _run(tmp_path, rounds, store=None, ckpt_dir=None, ckpt_path=None, save_top_k=0):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), StatefulFedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8), store=store)
    kw = {}
    if ckpt_dir is not None:
        callback = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=save_top_k)
        kw = dict(enable_checkpointing=True, callbacks=[callback])
    tiny_trainer(tmp_path, rounds, **kw).fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=ckpt_path)
    return module


def _mapped_from_its_file(table) -> bool:
    """The table's rows lie in a shared map of its file (/proc/self/maps: ``start-end perms ... path``)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(table.path) and fields[1].endswith("s"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= table.data.data_ptr() < end and start <= table.has.data_ptr() < end:
                return True
    return False


def test_disk_store_matches_memory_store_and_holds_nothing_in_memory(tmp_path):
    memory = _run(tmp_path, 4)
    disk = _run(tmp_path, 4, store=DiskClientStore(str(tmp_path / "store")))
    tables = disk.store._tables.values()
    assert len(disk.store) == len(memory.store) > 0 and tables
    assert all(_mapped_from_its_file(t) for t in tables), "client tensors must live in the mapped files only"
    assert sorted(t.path for t in tables) == sorted((tmp_path / "store" / "live").glob("*.table"))
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


def test_a_second_store_on_the_same_folder_is_refused_naming_the_owner(tmp_path):
    store = DiskClientStore(str(tmp_path))
    store.put(0, {"c": {"w": torch.ones(2)}})
    with pytest.raises(StoreError, match=f"^DiskClientStore directory {tmp_path} is in use by run {store.run_id} \\(pid {os.getpid()} "):
        DiskClientStore(str(tmp_path))
    assert torch.equal(store.get(0, dict)["c"]["w"], torch.ones(2)), "the owner's states are untouched"
    store.close()
    DiskClientStore(str(tmp_path)).close()  # a released folder can be taken


_HOLD = """
import sys, time
from fl_lightning.core.state import DiskClientStore
store = DiskClientStore(sys.argv[1])
print(store.run_id, flush=True)
time.sleep(60)
"""


def test_a_second_process_on_the_same_folder_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    owner = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        run_id = owner.stdout.readline().strip()
        assert run_id
        with pytest.raises(StoreError, match=f"in use by run {run_id} \\(pid {owner.pid} on .*give each run its own store directory"):
            DiskClientStore(str(tmp_path))
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
    DiskClientStore(str(tmp_path)).close()  # a dead owner's lock is gone with it


def test_every_retained_checkpoint_resumes_after_rotation(tmp_path):
    """save_top_k -1 keeps every checkpoint; keep_snapshots 1 used to delete all but the newest's snapshot."""
    first = _run(tmp_path / "a", 5, store=DiskClientStore(str(tmp_path / "a" / "store"), keep_snapshots=1), ckpt_dir=tmp_path / "ckpt", save_top_k=-1)
    first.store.close()
    checkpoints = sorted((tmp_path / "ckpt").glob("*step=*.ckpt"))
    assert len(checkpoints) == 5
    for i, ckpt in enumerate(checkpoints):
        step = torch.load(ckpt, weights_only=True)["global_step"]
        straight = _run(tmp_path / f"s{i}", step + 1, store=DiskClientStore(str(tmp_path / f"s{i}" / "store")))
        resumed = _run(tmp_path / f"r{i}", step + 1, store=DiskClientStore(str(tmp_path / f"r{i}" / "store")), ckpt_path=ckpt)
        assert straight.store.equal(resumed.store)
        straight.store.close()
        resumed.store.close()


def test_snapshots_no_checkpoint_references_are_deleted(tmp_path):
    module = _run(tmp_path, 5, store=DiskClientStore(str(tmp_path / "store"), keep_snapshots=1), ckpt_dir=tmp_path / "ckpt")
    snapshots = [p for p in (tmp_path / "store" / "snapshots").iterdir() if not p.name.startswith(".")]
    reference = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["federated"]["client_store"]["disk_snapshot"]
    assert [f"snapshots/{p.name}" for p in snapshots] == [reference]
    assert reference == f"snapshots/{module.store.run_id}-step_{5:09d}", "named by run id and step, relative to the store"


def test_resume_into_the_stores_own_folder_and_after_moving_it(tmp_path):
    straight = _run(tmp_path / "a", 6, store=DiskClientStore(str(tmp_path / "a" / "store")))
    first = _run(tmp_path / "b", 3, store=DiskClientStore(str(tmp_path / "b" / "store")), ckpt_dir=tmp_path / "b" / "ckpt")
    first.store.close()  # the first run ends (its process would exit)
    own = _run(tmp_path / "b", 6, store=DiskClientStore(str(tmp_path / "b" / "store")), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert straight.store.equal(own.store)
    own.store.close()
    shutil.move(tmp_path / "b", tmp_path / "moved")  # relative snapshot paths: a moved run folder still resumes
    moved = _run(tmp_path / "m", 6, store=DiskClientStore(str(tmp_path / "moved" / "store")), ckpt_path=str(tmp_path / "moved" / "ckpt" / "last.ckpt"))
    assert straight.store.equal(moved.store)


def test_a_fresh_run_into_a_folder_holding_a_finished_runs_states_is_refused(tmp_path):
    first = _run(tmp_path, 2, store=DiskClientStore(str(tmp_path / "store")))
    first.store.close()
    with pytest.raises(StoreError, match="holds the client states of run .* resume from one of its checkpoints .*or use an empty directory"):
        _run(tmp_path, 2, store=DiskClientStore(str(tmp_path / "store")))


def _snapshot(ckpt: Path, store: Path) -> Path:
    return store / torch.load(ckpt, weights_only=True)["federated"]["client_store"]["disk_snapshot"]


def test_a_damaged_snapshot_file_stops_the_run_naming_it(tmp_path):
    first = _run(tmp_path / "a", 3, store=DiskClientStore(str(tmp_path / "a" / "store")), ckpt_dir=tmp_path / "ckpt")
    first.store.close()
    victim = sorted(_snapshot(tmp_path / "ckpt" / "last.ckpt", tmp_path / "a" / "store").glob("table-*.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one client's row
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"^client-store file {victim} is damaged"):
        _run(tmp_path / "b", 5, store=DiskClientStore(str(tmp_path / "b" / "store")), ckpt_path=tmp_path / "ckpt" / "last.ckpt")

    store = DiskClientStore(str(tmp_path / "c"))
    store.put(3, {"c": {"w": torch.ones(4)}})
    record = store.checkpoint_state(1)
    rows = tmp_path / "c" / record["disk_snapshot"] / "rows.safetensors"
    rows.write_bytes(rows.read_bytes()[:-1])  # truncated
    store.put(3, {"c": {"w": torch.zeros(4)}})
    with pytest.raises(CheckpointError, match=f"^client-store file {rows} is damaged"):
        store.load_checkpoint_state(record)
    assert torch.equal(store.get(3, dict)["c"]["w"], torch.zeros(4)), "the live tables are untouched"


@pytest.mark.parametrize("crafted", ["../live", "/etc", "snapshots/../../x", "live"])
def test_a_crafted_snapshot_path_is_refused_before_anything_is_touched(tmp_path, crafted):
    store = DiskClientStore(str(tmp_path / "store"))
    store.put(1, {"c": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointError, match="client-store snapshot"):
        store.load_checkpoint_state({"disk_snapshot": crafted})
    assert torch.equal(store.get(1, dict)["c"]["w"], torch.ones(2)), "live/ is untouched"
    assert isinstance(CheckpointError("x"), FLError)


def test_each_ddp_process_holds_its_own_store_and_resumes_the_checkpoints_snapshot(tmp_path, monkeypatch):
    first = DiskClientStore(str(tmp_path))
    first.put(4, {"c": {"w": torch.arange(3.0)}})
    record = first.checkpoint_state(7)
    monkeypatch.setenv("LOCAL_RANK", "1")
    other = DiskClientStore(str(tmp_path))  # not refused: its own subfolder
    assert other.directory == tmp_path / "rank-0-1"
    other.load_checkpoint_state(record)
    assert torch.equal(other.get(4, dict)["c"]["w"], torch.arange(3.0))


def test_a_snapshot_is_deleted_only_after_no_written_checkpoint_references_it(tmp_path):
    """keep_snapshots 1: writing checkpoint 2 must not delete the snapshot checkpoint 1 (still the
    only complete checkpoint if the write is killed) references."""
    store = DiskClientStore(str(tmp_path / "store"), keep_snapshots=1)
    store.put(0, {"c": {"w": torch.ones(2)}})
    (tmp_path / "ckpt").mkdir()
    torch.save({"federated": {"client_store": store.checkpoint_state(1)}}, tmp_path / "ckpt" / "last.ckpt")
    first = tmp_path / "store" / f"snapshots/{store.run_id}-step_{1:09d}"
    second = store.checkpoint_state(2)  # the checkpoint callback is about to write it (and may be killed)
    assert first.is_dir()
    store.release_snapshots([str(tmp_path / "ckpt")])
    assert first.is_dir(), "last.ckpt still references it"
    torch.save({"federated": {"client_store": second}}, tmp_path / "ckpt" / "last.ckpt")
    store.release_snapshots([str(tmp_path / "ckpt")])
    assert not first.is_dir() and (tmp_path / "store" / second["disk_snapshot"]).is_dir()


def test_temporary_files_of_a_killed_store_are_removed_when_the_folder_is_next_opened(tmp_path):
    """A run killed while writing a client file or a snapshot left its temporaries (each a full client state,
    or links to all of them) in the store for ever; a folder holding only those counted as in use."""
    folder = tmp_path / "store"
    (folder / "live").mkdir(parents=True)
    (folder / "live" / "3.tmp").write_bytes(b"partial client state")
    (folder / "snapshots" / ".tmp-20260101-000000-deadbeef-step_000000004").mkdir(parents=True)
    (folder / "snapshots" / ".tmp-20260101-000000-deadbeef-step_000000004" / "3.safetensors").write_bytes(b"x")
    (folder / ".OWNER.20260101-000000-deadbeef.tmp").write_text("{}")
    store = DiskClientStore(str(folder))
    try:
        assert not (folder / "live" / "3.tmp").exists()
        assert not list((folder / "snapshots").iterdir())
        assert not list(folder.glob(".OWNER.*.tmp"))
        store.start()  # only temporaries were there: an empty store, not another run's live states
    finally:
        store.close()


def _init():
    return {"c": {"w": torch.zeros(3, 2, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.bfloat16)}, "n": {"k": torch.tensor(0)}}


def _new_states(generator, n):
    return {
        "c": {"w": torch.randn(n, 3, 2, dtype=torch.float64, generator=generator), "b": torch.randn(n, 5, generator=generator).bfloat16()},
        "n": {"k": torch.randint(0, 9, (n,), generator=generator)},
    }


def test_tables_on_disk_equal_the_memory_store_bitwise_through_growth_odd_tensors_and_snapshots(tmp_path):
    from fl_lightning.core.state import ClientStore
    from tests.test_state_tables import _assert_same

    disk, memory, generator = DiskClientStore(str(tmp_path / "a")), ClientStore(), torch.Generator().manual_seed(0)
    for step in range(12):
        ids = torch.randint(0, 60, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
        _assert_same(disk.gather(ids, _init), memory.gather(ids, _init))
        new = _new_states(generator, len(ids))
        disk.scatter(ids, new), memory.scatter(ids, new)
        one = {"c": {"w": torch.randn(3, 2, dtype=torch.float64, generator=generator)}}  # holds no c/b, no n/k
        cid = int(torch.randint(0, 60, (1,), generator=generator))
        disk.put(cid, one), memory.put(cid, one)
        if step == 3:  # a shape that fits no table, kept beside the tables
            odd = {"c": {"w": torch.randn(7, generator=generator)}, "extra": {"e": torch.arange(3)}}
            disk.put(100 + step, odd), memory.put(100 + step, odd)
        if step == 6:  # snapshot and restore into a new folder, then keep going (the restored tables grow)
            capacity = next(iter(disk._tables.values())).capacity
            record = disk.checkpoint_state(step)
            disk.close()
            disk = DiskClientStore(str(tmp_path / "b"))
            disk.load_checkpoint_state(record)
            assert disk.equal(memory) and disk._odd
    assert next(iter(disk._tables.values())).capacity > capacity >= 8, "the tables grew before and after the restore"
    assert disk.equal(memory) and disk.entries() == memory.entries() and disk.client_ids() == memory.client_ids()
    for cid in memory.client_ids():
        _assert_same(disk.get(cid, dict), memory.get(cid, dict))
    disk.close()


def _old_layout_snapshot(folder: Path, run: str, step: int, flat: dict) -> dict:
    """A snapshot as the per-client-file store wrote it: ``<client>.safetensors`` of ``{"<state>/<param>": tensor}``
    and a manifest of each file's SHA-256, clients in id order; the checkpoint's record of it."""
    import hashlib
    import json

    from safetensors.torch import save

    snapshot = folder / "snapshots" / f"{run}-step_{step:09d}"
    snapshot.mkdir(parents=True)
    per_client = {}
    for key, tensor in flat.items():
        cid, rest = key.split("/", 1)
        per_client.setdefault(int(cid), {})[rest] = tensor.contiguous()
    files = {}
    for cid in sorted(per_client):
        data = save(per_client[cid])
        (snapshot / f"{cid}.safetensors").write_bytes(data)
        files[f"{cid}.safetensors"] = hashlib.sha256(data).hexdigest()
    (snapshot / "manifest.json").write_text(json.dumps({"run_id": run, "step": step, "files": files}))
    return {"disk_snapshot": f"snapshots/{snapshot.name}", "disk_store": str(folder.resolve()), "store_run": run}


def test_a_checkpoint_of_the_per_client_file_layout_resumes_bitwise(tmp_path):
    straight = _run(tmp_path / "a", 6, store=DiskClientStore(str(tmp_path / "a" / "store")))
    first = _run(tmp_path / "b", 3, store=DiskClientStore(str(tmp_path / "b" / "store")), ckpt_dir=tmp_path / "b" / "ckpt")
    ckpt = torch.load(tmp_path / "b" / "ckpt" / "last.ckpt", weights_only=True)
    ckpt["federated"]["client_store"] = _old_layout_snapshot(tmp_path / "old", "20260101-000000-deadbeef", 3, first.store.state_dict())
    torch.save(ckpt, tmp_path / "old.ckpt")
    resumed = _run(tmp_path / "c", 6, store=DiskClientStore(str(tmp_path / "c" / "store")), ckpt_path=str(tmp_path / "old.ckpt"))
    assert straight.store.equal(resumed.store) and len(resumed.store) > 0
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)

    victim = sorted((tmp_path / "old" / "snapshots").glob("*/*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    store = DiskClientStore(str(tmp_path / "d"))
    with pytest.raises(CheckpointError, match=f"^client-store file {victim} is damaged"):
        store.load_checkpoint_state(ckpt["federated"]["client_store"])
    store.close()


def test_a_snapshot_that_cannot_be_written_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from fl_lightning.core import tables

    store = DiskClientStore(str(tmp_path))
    store.put(2, {"c": {"w": torch.ones(3)}})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tables, "copy_range", full)
    with pytest.raises(FLError, match=f"^cannot write the DiskClientStore snapshot {store.run_id}-step_000000004: no space left on the device of "
                                      f"{tmp_path / 'snapshots'} .*the live client states and the last checkpoint are intact; free space"):  # fmt: skip
        store.checkpoint_state(4)
    assert not list((tmp_path / "snapshots").iterdir()) and torch.equal(store.get(2, dict)["c"]["w"], torch.ones(3))
    store.close()
