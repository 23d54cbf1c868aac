"""Persistent tensors that outlive a round: per-client state and server state.

Ownership: algorithms *declare* state (names and initial values); the
``FederatedModule`` is the only writer; the store travels in every checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor

from fl_lightning.core.errors import CheckpointError, StoreError
from fl_lightning.core.params import TensorDict
from fl_lightning.core.tables import _MappedTable, _Table, copy_file, file_sha256

log = logging.getLogger(__name__)

NestedState = dict[str, TensorDict]
"""State of one party: ``{state_name: {param_name: tensor}}`` (e.g. SCAFFOLD's ``{"c": {...}}``)."""

StateInit = Callable[[], NestedState]


def flatten_state(state: NestedState, prefix: str = "") -> dict[str, Tensor]:
    """``{"<prefix><state>/<param>": tensor}``: tensors only, safe for ``weights_only`` loading."""
    return {f"{prefix}{name}/{param}": t for name, td in state.items() for param, t in td.items()}


def unflatten_state(flat: dict[str, Tensor]) -> NestedState:
    state: NestedState = {}
    for key, tensor in flat.items():
        name, param = key.split("/", 1)
        state.setdefault(name, {})[param] = tensor
    return state


class ClientStore:
    """Per-client tensor dicts kept as stacked tables, created lazily the first time a client is seen.

    Each (state, param) is one table ``[capacity, *shape]``; a client owns one row of every
    table (``row_of[client_id]``, -1 where absent), rows given in the order clients first
    appear and the capacity grown geometrically. Clients that never trained hold nothing,
    so memory grows with the number of *participating* clients, not with the population size.
    ``gather`` / ``scatter`` read and write many clients' rows in one indexed op per tensor;
    ``get`` / ``put`` are the same for one client (a ``get`` returns copies, never views of a table).
    A tensor whose shape or dtype differs from its table's is kept beside the tables, for that client.
    """

    def __init__(self) -> None:
        self._clear_tables()

    def _clear_tables(self) -> None:
        self._tables: dict[tuple[str, str], _Table] = {}
        self._odd: dict[int, dict[tuple[str, str], Tensor]] = {}  # client -> tensors that fit no table
        self._row_of = torch.full((0,), -1, dtype=torch.int64)
        self._client_of: list[int] = []  # row -> client

    # ---- rows ---------------------------------------------------------------------------------
    def _rows(self, ids: Tensor) -> Tensor:
        """Each client's row, -1 for a client without one."""
        inside = ids < len(self._row_of)
        rows = torch.full_like(ids, -1)
        rows[inside] = self._row_of[ids[inside]]
        return rows

    def _assign(self, ids: Tensor) -> Tensor:
        """The clients' rows, new rows given (in order) to clients without one; tables grown to fit."""
        top = int(ids.max()) + 1 if len(ids) else 0
        if top > len(self._row_of):
            grown = torch.full((max(top, 2 * len(self._row_of)),), -1, dtype=torch.int64)
            grown[: len(self._row_of)] = self._row_of
            self._row_of = grown
        rows = self._row_of[ids]
        if bool((rows < 0).any()):
            for cid in ids[rows < 0].tolist():  # only clients seen for the first time
                if self._row_of[cid] < 0:
                    self._row_of[cid] = len(self._client_of)
                    self._client_of.append(cid)
            rows = self._row_of[ids]
            capacity = self._capacity()
            if len(self._client_of) > capacity:
                for table in self._tables.values():
                    table.grow(max(len(self._client_of), 2 * capacity))
        return rows

    def _capacity(self) -> int:
        return len(next(iter(self._tables.values())).has) if self._tables else 0

    def _table(self, key: tuple[str, str], like: Tensor) -> _Table:
        if key not in self._tables:
            self._tables[key] = self._new_table(like, max(self._capacity(), len(self._client_of), 1))
        return self._tables[key]

    def _new_table(self, like: Tensor, capacity: int) -> _Table:
        return _Table(like, capacity)

    # ---- many clients -------------------------------------------------------------------------
    def gather(self, ids: Tensor, init: StateInit) -> NestedState:
        """The clients' states stacked ``[S, ...]`` for every entry of ``init()``; a client without a
        value for an entry (never stored) gets ``init()``'s, which is not stored."""
        initial = init()
        if not any(initial.values()):  # a rule without client state (FedAvg): no rows to look up
            return {}
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        rows = self._rows(ids)
        stacked: NestedState = {}
        for name, td in initial.items():
            for param, first in td.items():
                table = self._tables.get((name, param))
                if table is not None and not table.fits(first) and bool(table.has.any()):
                    raise StoreError(
                        f"client state {name}/{param} is stored as {tuple(table.data.shape[1:])} {table.data.dtype}, "
                        f"its initial value is {tuple(first.shape)} {first.dtype}: the states cannot be stacked"
                    )
                held = (rows >= 0) & table.has[rows.clamp(min=0)] if table is not None else None
                if held is not None and bool(held.any()):
                    out = table.data.index_select(0, rows.clamp(min=0).to(table.data.device)).to(first.device)
                    if not bool(held.all()):
                        out[~held.to(out.device)] = first.detach().to(out.dtype)
                else:
                    out = first.detach().unsqueeze(0).expand(len(ids), *first.shape).clone()
                for i, cid in enumerate(ids.tolist()) if self._odd else ():
                    odd = self._odd.get(cid, {}).get((name, param))
                    if odd is not None:
                        out[i] = odd
                stacked.setdefault(name, {})[param] = out
        return stacked

    def scatter(self, ids: Tensor, stacked: NestedState) -> None:
        """Each client ``ids[i]``'s state becomes row ``i`` of ``stacked`` (as ``put``; a repeated id: its last row)."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if not stacked or not any(stacked.values()) or not len(ids):
            return
        rows = self._assign(ids)  # new clients' rows in order of first appearance, as a loop of ``put``
        positions = ids.tolist()
        if len(set(positions)) != len(positions):
            last = {cid: i for i, cid in enumerate(positions)}
            keep = torch.tensor(sorted(last.values()))
            ids, rows, stacked = ids[keep], rows[keep], {n: {k: v[keep] for k, v in td.items()} for n, td in stacked.items()}
        if self._odd:
            for cid in ids.tolist():
                self._odd.pop(cid, None)
        given = set()
        for name, td in stacked.items():
            for param, values in td.items():
                values = values.detach()
                table = self._table((name, param), values[0])
                if table.fits(values[0]):
                    table.data.index_copy_(0, rows.to(table.data.device), values.to(table.data.device))
                    given.add((name, param))
                else:
                    for cid, value in zip(ids.tolist(), values):
                        self._odd.setdefault(cid, {})[(name, param)] = value.clone()
        for key, table in self._tables.items():
            table.has[rows] = key in given

    def entries(self) -> set[tuple[str, str]] | None:
        """Every (state, param) some client holds (None: not known without reading every client)."""
        return {key for key, table in self._tables.items() if bool(table.has.any())} | {k for odd in self._odd.values() for k in odd}

    # ---- one client ---------------------------------------------------------------------------
    def __contains__(self, client_id: int) -> bool:
        cid = int(client_id)
        return 0 <= cid < len(self._row_of) and int(self._row_of[cid]) >= 0

    def __len__(self) -> int:
        return len(self._client_of)

    def client_ids(self) -> list[int]:
        return sorted(self._client_of)

    def _stored(self, cid: int) -> NestedState:
        row = int(self._row_of[cid])
        state: NestedState = {}
        odd = self._odd.get(cid, {})
        for (name, param), table in self._tables.items():
            if (name, param) in odd:
                state.setdefault(name, {})[param] = odd[(name, param)].clone()
            elif table.has[row]:
                state.setdefault(name, {})[param] = table.data[row].clone()
        return state

    def get(self, client_id: int, init: StateInit) -> NestedState:
        """The client's state; ``init()`` creates it on first access (not stored until ``put``)."""
        return self._stored(int(client_id)) if client_id in self else init()

    def put(self, client_id: int, state: NestedState) -> None:
        if state and any(state.values()):
            self.scatter(torch.tensor([int(client_id)]), {n: {k: v.detach().unsqueeze(0) for k, v in td.items()} for n, td in state.items()})

    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{"<client>/<state>/<param>": tensor}`` mapping, clients in the order they first appeared."""
        flat: dict[str, Tensor] = {}
        for cid in self._client_of:
            flat.update(flatten_state(self._stored(cid), prefix=f"{cid}/"))
        return flat

    def load_state_dict(self, flat: dict[str, Tensor]) -> None:
        per_client: dict[int, dict[str, Tensor]] = {}
        for key, tensor in flat.items():
            cid, rest = key.split("/", 1)
            per_client.setdefault(int(cid), {})[rest] = tensor
        self._clear_tables()
        for cid, f in per_client.items():
            self.put(cid, unflatten_state(f))

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint records of the store (here: every tensor)."""
        return self.state_dict()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)

    def start(self) -> None:
        """Called before round 0 (after any resume); a store may refuse to start here."""

    def release_snapshots(self, checkpoint_dirs: list[str]) -> None:
        """Called after checkpoints are written: a store may free what no checkpoint references."""

    def equal(self, other: ClientStore) -> bool:
        """Bitwise equality of every client's every tensor."""
        a, b = self.state_dict(), other.state_dict()
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class DiskClientStore(ClientStore):
    """Client states as stacked tables in files mapped into memory: resident memory independent of N.

    Each (state, param) is one table file in ``live/`` (``has`` mask and rows, ``_MappedTable``), mapped
    shared into the process: ``gather`` / ``scatter`` are one ``index_select`` / ``index_copy_`` per
    tensor on the map, exactly as ``ClientStore``'s tables, and what is resident is page cache, which the
    kernel writes back and reclaims. The row table (client -> row, 8 bytes a client) is kept in memory, and
    so are tensors that fit no table (``ClientStore._odd``). Live tables are trusted within the process, as
    the in-memory store's are; checksums guard the snapshots.

    A checkpoint records a snapshot, ``snapshots/<run id>-step_<n>`` (a path relative to the store): every
    table's rows in use copied file to file by the kernel (``copy_file_range``: a reflink, no data copied,
    where the file system shares blocks, e.g. btrfs or XFS; the slack of geometric growth left out), the
    row table and the odd tensors (``rows.safetensors``, ``odd.safetensors``) and a manifest of every
    file's SHA-256 and every table's entry, dtype, shape and capacity; written to ``snapshots/.tmp-<name>``
    and renamed. No flush of the maps comes first: writes through a shared map are in the page cache that
    the copy reads (a reflink writes the dirty pages back first). Resuming from that checkpoint checks
    every file of exactly that snapshot against its manifest before ``live/`` is touched, then copies the
    tables back and maps them. A snapshot of the earlier layout (one safetensors file per client, their
    checksums in its manifest) resumes too, each client file checked and read into the tables.

    The store owns its folder: it holds an exclusive lock (``.lock``, released when the
    process ends) and names its run in ``OWNER.json``, so a second run on the same folder
    is refused with the owner's run id. A fresh run into a folder whose live states belong
    to a finished run is refused too; resuming from one of that run's checkpoints (into the
    same folder or a new one) is not.

    Under DDP every process holds its own store: processes other than the first use the
    subfolder ``rank-<node>-<local rank>``; a resume restores the snapshot the checkpoint
    (written by the first process) names, on every process.

    Snapshots of this run are deleted only when no checkpoint file in the trainer's
    checkpoint folders references them, keeping the newest ``keep_snapshots`` in any case;
    snapshots of other runs are never deleted.

    Args:
        directory: where the files live (created).
        keep_snapshots: this run's newest snapshots always kept, >= 1.
    """

    def __init__(self, directory: str, keep_snapshots: int = 2) -> None:
        super().__init__()
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        self.directory = Path(directory)
        rank = (int(os.environ.get("NODE_RANK") or 0), int(os.environ.get("LOCAL_RANK") or 0))  # set for DDP's processes
        if rank != (0, 0):
            self.directory = self.directory / f"rank-{rank[0]}-{rank[1]}"
        self.keep_snapshots = keep_snapshots
        self.run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire()
        self.live = self.directory / "live"
        self.snapshots = self.directory / "snapshots"
        self._remove_temporaries()
        self._stale = self._previous_owner() if self.live.exists() and any(self.live.iterdir()) else None
        self.live.mkdir(parents=True, exist_ok=True)
        self._files = 0  # table files made by this run: each new file gets the next number
        self._made: list[str] = []  # this run's snapshots, oldest first
        self._references: dict[tuple[str, int, int], str | None] = {}  # (checkpoint, mtime, size) -> its snapshot

    # ---- ownership ---------------------------------------------------------------------------
    def _acquire(self):
        import fcntl

        handle = open(self.directory / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            owner = self._owner_text(self._read_owner())
            raise StoreError(
                f"DiskClientStore directory {self.directory} is in use by {owner}; give each run its own store directory"
            ) from None
        self._stale_owner = self._read_owner()
        marker = {"run_id": self.run_id, "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tmp = self.directory / f".OWNER.{self.run_id}.tmp"
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, self.directory / "OWNER.json")
        return handle

    def _remove_temporaries(self) -> None:
        """Delete what a killed run left half-written (safe: this run holds the folder's lock): table files
        (``live/*.tmp``), snapshots (``snapshots/.tmp-*``) and owner markers (``.OWNER.*.tmp``)."""
        leftovers = [*self.live.glob("*.tmp"), *self.snapshots.glob(".tmp-*"), *self.directory.glob(".OWNER.*.tmp")]
        for path in leftovers:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
            log.info("DiskClientStore %s: removed %s, left by a write that did not finish", self.directory, path.name)

    def _read_owner(self) -> dict[str, Any]:
        try:
            return json.loads((self.directory / "OWNER.json").read_text())
        except (OSError, ValueError):
            return {}

    @staticmethod
    def _owner_text(owner: dict[str, Any]) -> str:
        if not owner.get("run_id"):
            return "another run"
        return f"run {owner['run_id']} (pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('started')})"

    def _previous_owner(self) -> str:
        return self._owner_text(self._stale_owner)

    def close(self) -> None:
        """Release the folder (the lock is also released when the process ends)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.close()
            self._lock = None

    def __del__(self) -> None:
        self.close()

    def start(self) -> None:
        """Before round 0 (after any resume): refuse live states that belong to a finished run."""
        if self._stale:
            raise StoreError(
                f"DiskClientStore directory {self.directory} holds the client states of {self._stale}; "
                "resume from one of its checkpoints (--ckpt_path), or use an empty directory"
            )

    # ---- tables ------------------------------------------------------------------------------
    def _new_path(self) -> Path:
        """A fresh live table file: run id and number, so that no run's file is ever another's."""
        self._files += 1
        return self.live / f"{self.run_id}-{self._files:06d}.table"

    def _new_table(self, like: Tensor, capacity: int) -> _MappedTable:
        return _MappedTable(like.shape, like.dtype, capacity, self._new_path)

    def scatter(self, ids: Tensor, stacked: NestedState) -> None:
        super().scatter(ids, stacked)
        self._stale = None  # this run writes its own states now

    def _clear_tables(self) -> None:
        """No tables and an empty ``live/`` (a resume's, or a load's, start)."""
        if "live" in self.__dict__:  # not while ``ClientStore.__init__`` runs
            for table in self._tables.values():
                table.close()
            shutil.rmtree(self.live)
            self.live.mkdir()
            self._stale = None
        super()._clear_tables()

    # ---- snapshots -------------------------------------------------------------------------------
    def checkpoint_state(self, step: int) -> dict[str, Any]:
        name = f"{self.run_id}-step_{step:09d}"
        target = self.snapshots / name
        if name not in self._made or not target.is_dir():  # the same step again (e.g. after validation): unchanged
            tmp = self.snapshots / f".tmp-{name}"
            try:
                self._write_snapshot(tmp, step)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except OSError as error:  # a full or read-only store folder: one line naming it
                shutil.rmtree(tmp, ignore_errors=True)
                from fl_lightning.core.errors import write_failure

                size = sum(t.path.stat().st_size for t in self._tables.values())
                raise write_failure(error, "DiskClientStore snapshot", target, size, "the live client states and the last checkpoint are intact") from error
            self._made = [n for n in self._made if n != name] + [name]
        return {"disk_snapshot": f"snapshots/{name}", "disk_store": str(self.directory.resolve()), "store_run": self.run_id}

    def _write_snapshot(self, folder: Path, step: int) -> None:
        from safetensors.torch import save_file

        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        tables = []
        for i, ((state, param), table) in enumerate(self._tables.items()):
            tables.append({"file": f"table-{i:04d}.bin", "state": state, "param": param, "dtype": str(table.dtype).removeprefix("torch."),
                           "shape": list(table.shape), "capacity": len(self._client_of)})  # fmt: skip
            table.save(folder / tables[-1]["file"], len(self._client_of))
        save_file({"client_of": torch.tensor(self._client_of, dtype=torch.int64)}, folder / _ROWS)
        if self._odd:
            save_file({f"{cid}/{n}/{k}": t.contiguous() for cid, odd in self._odd.items() for (n, k), t in odd.items()}, folder / _ODD)
        files = {f.name: file_sha256(f) for f in sorted(folder.iterdir())}
        manifest = {"format": _FORMAT, "run_id": self.run_id, "step": step, "files": files, "tables": tables}
        (folder / _MANIFEST).write_text(json.dumps(manifest))

    def _resolve_snapshot(self, state: dict[str, Any]) -> Path:
        """The snapshot a checkpoint names, validated to be a snapshot folder inside a store."""
        recorded = str(state["disk_snapshot"])
        path = PurePosixPath(recorded)
        if path.is_absolute():  # checkpoints before relative paths: an absolute ".../snapshots/step_N"
            candidate = Path(recorded)
            if candidate.parent.name == "snapshots" and re.fullmatch(r"step_\d+", candidate.name) and candidate.is_dir():
                return candidate
            raise CheckpointError(f"client-store snapshot {recorded} of this checkpoint is not a store snapshot folder or no longer exists")
        if len(path.parts) != 2 or path.parts[0] != "snapshots" or not _SNAPSHOT_NAME.fullmatch(path.parts[1]):
            raise CheckpointError(f"client-store snapshot {recorded} of this checkpoint is not a snapshot path of a store (snapshots/<run>-step_<n>)")
        bases = [self.directory] + ([Path(state["disk_store"])] if state.get("disk_store") else [])
        for base in bases:
            candidate = base / path
            if candidate.is_dir() and candidate.resolve().parent == (base / "snapshots").resolve():
                return candidate
        where = " or ".join(str(b / path) for b in bases)
        raise CheckpointError(f"client-store snapshot {recorded} of this checkpoint no longer exists (looked in {where})")

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if "disk_snapshot" not in state:  # a checkpoint of an in-memory store
            self.load_state_dict(state)
            return
        snapshot = self._resolve_snapshot(state)
        manifest = _verified_manifest(snapshot)  # everything checked before live/ is touched
        self._clear_tables()
        if manifest.get("format") != _FORMAT:  # the earlier layout: one file per client
            from safetensors.torch import load_file

            for name in manifest["files"]:
                self.put(int(name.split(".")[0]), unflatten_state(load_file(snapshot / name)))
            return
        self._load_snapshot(snapshot, manifest["tables"])

    def _load_snapshot(self, snapshot: Path, tables: list[dict[str, Any]]) -> None:
        from safetensors.torch import load_file

        for entry in tables:
            path = self._new_path()
            copy_file(snapshot / entry["file"], path)
            dtype = getattr(torch, entry["dtype"])
            self._tables[(entry["state"], entry["param"])] = _MappedTable(entry["shape"], dtype, entry["capacity"], self._new_path, path)
        self._client_of = load_file(snapshot / _ROWS)["client_of"].tolist()
        self._row_of = torch.full((max(self._client_of, default=-1) + 1,), -1, dtype=torch.int64)
        self._row_of[torch.tensor(self._client_of, dtype=torch.int64)] = torch.arange(len(self._client_of))
        if (snapshot / _ODD).exists():
            for key, tensor in load_file(snapshot / _ODD).items():
                cid, name, param = key.split("/", 2)
                self._odd.setdefault(int(cid), {})[(name, param)] = tensor

    def release_snapshots(self, checkpoint_dirs: list[str]) -> None:
        """Delete this run's snapshots that no checkpoint file in ``checkpoint_dirs`` references,
        except the newest ``keep_snapshots``; nothing when a checkpoint cannot be read."""
        candidates = self._made[: -self.keep_snapshots]
        if not candidates:
            return
        referenced = set()
        for folder in checkpoint_dirs:
            try:
                files = [p for p in Path(folder).iterdir() if p.suffix == ".ckpt"] if Path(folder).is_dir() else []
            except OSError:
                return
            for file in files:
                ref = self._reference(file)
                if ref is _UNREADABLE:
                    return
                referenced.add(ref)
        for name in candidates:
            if f"snapshots/{name}" not in referenced:
                shutil.rmtree(self.snapshots / name, ignore_errors=True)
                self._made.remove(name)

    def _reference(self, checkpoint: Path) -> Any:
        """The snapshot a checkpoint file references (None: none of this store's), cached by mtime and size."""
        try:
            stat = checkpoint.stat()
        except OSError:
            return None  # deleted meanwhile: references nothing
        key = (str(checkpoint), stat.st_mtime_ns, stat.st_size)
        if key not in self._references:
            try:
                ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
                store = ckpt.get("federated", {}).get("client_store", {})
                self._references[key] = store.get("disk_snapshot") if isinstance(store.get("disk_snapshot"), str) else None
            except Exception:
                return _UNREADABLE
        return self._references[key]


def _verified_manifest(snapshot: Path) -> dict[str, Any]:
    """A snapshot's manifest, every file it names checked against its SHA-256 (and every table file's size
    against its table); a snapshot of the earlier layout without a manifest: its client files, unchecked."""
    manifest_path = snapshot / _MANIFEST
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            files = dict(manifest["files"])
            tables = manifest.get("tables", []) if manifest.get("format") == _FORMAT else None
            sizes = {t["file"]: _MappedTable.layout(tuple(t["shape"]), getattr(torch, t["dtype"]), int(t["capacity"]))[1] for t in tables or ()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"client-store snapshot {snapshot}: its manifest is damaged ({error})") from error
    else:  # snapshots before manifests: client files, unchecked
        manifest = {"files": {f.name: None for f in sorted(snapshot.iterdir()) if _CLIENT_FILE.fullmatch(f.name)}}
        files, tables, sizes = manifest["files"], None, {}
    allowed = _TABLE_FILE if tables is not None else _CLIENT_FILE
    for name in [*sizes, *([_ROWS] if tables is not None else [])]:
        if name not in files:
            raise CheckpointError(f"client-store snapshot {snapshot}: its manifest has no checksum of {name!r}")
    for name, digest in files.items():
        path = snapshot / name
        if not allowed.fullmatch(name):
            raise CheckpointError(f"client-store snapshot {snapshot}: its manifest names {name!r}, not a client-store file")
        try:
            actual = file_sha256(path)
            wrong_size = name in sizes and path.stat().st_size != sizes[name]
        except OSError as error:
            raise CheckpointError(f"client-store file {path} of this checkpoint's snapshot cannot be read ({error.strerror})") from error
        if (digest is not None and actual != digest) or wrong_size:
            raise CheckpointError(
                f"client-store file {path} is damaged (its checksum differs from the snapshot manifest: truncated or modified); "
                "resume from an earlier checkpoint"
            )
    return manifest


_MANIFEST = "manifest.json"
_FORMAT = "tables-1"
_ROWS, _ODD = "rows.safetensors", "odd.safetensors"
_CLIENT_FILE = re.compile(r"\d+\.safetensors")
_TABLE_FILE = re.compile(r"table-\d+\.bin|rows\.safetensors|odd\.safetensors")
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_-]+-step_\d+")
_UNREADABLE = object()
