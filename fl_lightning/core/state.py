"""Persistent tensors that outlive a round: per-client state and server state.

Ownership: algorithms *declare* state (names and initial values); the
``FederatedModule`` is the only writer; the store travels in every checkpoint.
"""

from __future__ import annotations

import hashlib
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


class _Table:
    """One (state, param)'s tensors of every client that holds it: ``data[row]``, where ``has[row]``."""

    def __init__(self, like: Tensor, capacity: int) -> None:
        self.data = torch.empty((capacity, *like.shape), dtype=like.dtype, device=like.device)
        self.has = torch.zeros(capacity, dtype=torch.bool)

    def fits(self, tensor: Tensor) -> bool:
        return tensor.shape == self.data.shape[1:] and tensor.dtype == self.data.dtype

    def grow(self, capacity: int) -> None:
        data = torch.empty((capacity, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)
        data[: len(self.data)] = self.data
        has = torch.zeros(capacity, dtype=torch.bool)
        has[: len(self.has)] = self.has
        self.data, self.has = data, has


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
            self._tables[key] = _Table(like, max(self._capacity(), len(self._client_of), 1))
        return self._tables[key]

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
    """Client states in one safetensors file per client: resident memory independent of N.

    Only the round's active clients are read; each ``put`` atomically replaces the
    client's file and records its SHA-256, checked on every read. A checkpoint records a
    snapshot of the directory made of hard links (no data copied; files are never
    modified in place), named by the store's run id and the step, with a manifest of
    every file's checksum, by a path relative to the store; resuming from that
    checkpoint verifies and restores exactly that snapshot.

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
        self._ids: set[int] = set()
        self._sums: dict[int, str] = {}  # client -> SHA-256 of its live file
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
        """Delete what a killed run left half-written (safe: this run holds the folder's lock): client files
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

    # ---- client files ------------------------------------------------------------------------
    def _path(self, client_id: int) -> Path:
        return self.live / f"{int(client_id)}.safetensors"

    def __contains__(self, client_id: int) -> bool:
        return int(client_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def client_ids(self) -> list[int]:
        return sorted(self._ids)

    def get(self, client_id: int, init: StateInit) -> NestedState:
        from safetensors.torch import load

        if int(client_id) not in self._ids:
            return init()
        path = self._path(client_id)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise StoreError(f"client file {path} cannot be read ({error.strerror}); resume from a checkpoint") from error
        if hashlib.sha256(data).hexdigest() != self._sums[int(client_id)]:
            raise StoreError(
                f"client file {path} is damaged (its checksum differs from the one written: truncated or modified); "
                "resume from a checkpoint"
            )
        return unflatten_state(load(data))

    def put(self, client_id: int, state: NestedState) -> None:
        from safetensors.torch import save

        if not state:
            return
        flat = {k: v.detach().cpu().clone().contiguous() for k, v in flatten_state(state).items()}
        data = save(flat)
        tmp = self._path(client_id).with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self._path(client_id))
        except OSError as error:  # a full or read-only store folder: one line naming it
            tmp.unlink(missing_ok=True)
            from fl_lightning.core.errors import write_failure

            after = f"client {client_id}'s previous state and the last checkpoint are intact"
            raise write_failure(error, "DiskClientStore client file", tmp.with_suffix(".safetensors"), len(data), after) from error
        self._ids.add(int(client_id))
        self._sums[int(client_id)] = hashlib.sha256(data).hexdigest()
        self._stale = None  # this run writes its own states now

    def gather(self, ids: Tensor, init: StateInit) -> NestedState:
        """As ``ClientStore.gather``, reading the clients' files one by one (the format is one file per client)."""
        first = init()
        states = [self.get(cid, dict) for cid in torch.as_tensor(ids).reshape(-1).tolist()]
        return {
            n: {k: torch.stack([s.get(n, {}).get(k, v).to(v.device) for s in states]) if states else v.unsqueeze(0)[:0] for k, v in td.items()}
            for n, td in first.items()
        }  # fmt: skip

    def entries(self) -> set[tuple[str, str]] | None:
        return None

    def scatter(self, ids: Tensor, stacked: NestedState) -> None:
        """As ``ClientStore.scatter``: one ``put`` (one file) per client."""
        for i, cid in enumerate(torch.as_tensor(ids).reshape(-1).tolist()):
            self.put(cid, {n: {k: v[i] for k, v in td.items()} for n, td in stacked.items()})

    def state_dict(self) -> dict[str, Tensor]:
        flat: dict[str, Tensor] = {}
        for cid in self.client_ids():
            flat.update(flatten_state(self.get(cid, dict), prefix=f"{cid}/"))
        return flat

    def _clear_live(self) -> None:
        shutil.rmtree(self.live)
        self.live.mkdir()
        self._ids, self._sums, self._stale = set(), {}, None

    def load_state_dict(self, flat: dict[str, Tensor]) -> None:
        memory = ClientStore()
        memory.load_state_dict(flat)
        self._clear_live()
        for cid in memory.client_ids():
            self.put(cid, memory.get(cid, dict))

    # ---- snapshots -------------------------------------------------------------------------------
    def checkpoint_state(self, step: int) -> dict[str, Any]:
        name = f"{self.run_id}-step_{step:09d}"
        target = self.snapshots / name
        if name not in self._made or not target.is_dir():  # the same step again (e.g. after validation): unchanged
            tmp = self.snapshots / f".tmp-{name}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            files = {}
            for cid in sorted(self._ids):
                os.link(self._path(cid), tmp / self._path(cid).name)
                files[self._path(cid).name] = self._sums[cid]
            manifest = {"run_id": self.run_id, "step": step, "files": files}
            (tmp / _MANIFEST).write_text(json.dumps(manifest))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
            self._made = [n for n in self._made if n != name] + [name]
        return {"disk_snapshot": f"snapshots/{name}", "disk_store": str(self.directory.resolve()), "store_run": self.run_id}

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
        files = self._verified_files(snapshot)  # everything checked before live/ is touched
        self._clear_live()
        for name, digest in files.items():
            try:
                os.link(snapshot / name, self.live / name)
            except OSError:  # another file system
                shutil.copyfile(snapshot / name, self.live / name)
            cid = int(name.split(".")[0])
            self._ids.add(cid)
            self._sums[cid] = digest

    def _verified_files(self, snapshot: Path) -> dict[str, str]:
        """``{file name: SHA-256}`` of a snapshot's client files, each checked against its manifest."""
        manifest_path = snapshot / _MANIFEST
        if manifest_path.exists():
            try:
                files = dict(json.loads(manifest_path.read_text())["files"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"client-store snapshot {snapshot}: its manifest is damaged ({error})") from error
        else:  # snapshots before manifests: client files, unchecked
            files = {f.name: None for f in snapshot.iterdir() if _CLIENT_FILE.fullmatch(f.name)}
        for name, digest in files.items():
            path = snapshot / name
            if not _CLIENT_FILE.fullmatch(name):
                raise CheckpointError(f"client-store snapshot {snapshot}: its manifest names {name!r}, not a client file")
            try:
                data = path.read_bytes()
            except OSError as error:
                raise CheckpointError(f"client file {path} of this checkpoint's snapshot cannot be read ({error.strerror})") from error
            actual = hashlib.sha256(data).hexdigest()
            if digest is not None and actual != digest:
                raise CheckpointError(
                    f"client file {path} is damaged (its checksum differs from the snapshot manifest: truncated or modified); "
                    "resume from an earlier checkpoint"
                )
            files[name] = actual
        return files

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


_MANIFEST = "manifest.json"
_CLIENT_FILE = re.compile(r"\d+\.safetensors")
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9_-]+-step_\d+")
_UNREADABLE = object()
