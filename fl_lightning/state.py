"""Persistent tensors that outlive a round: per-client state and server state.

Ownership: algorithms *declare* state (names and initial values); the
``FederatedModule`` is the only writer; the store travels in every checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fl_lightning.params import TensorDict

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


def _own(tensor: Tensor) -> Tensor:
    """A detached tensor that does not keep a larger storage alive (e.g. a slice of stacked clients)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor._base is not None else tensor


class ClientStore:
    """Per-client tensor dicts, created lazily the first time a client is seen.

    Clients that never trained hold nothing, so memory grows with the number of
    *participating* clients, not with the population size.
    """

    def __init__(self) -> None:
        self._states: dict[int, NestedState] = {}

    def __contains__(self, client_id: int) -> bool:
        return int(client_id) in self._states

    def __len__(self) -> int:
        return len(self._states)

    def client_ids(self) -> list[int]:
        return sorted(self._states)

    def get(self, client_id: int, init: StateInit) -> NestedState:
        """The client's state; ``init()`` creates it on first access (not stored until ``put``)."""
        state = self._states.get(int(client_id))
        return init() if state is None else state

    def put(self, client_id: int, state: NestedState) -> None:
        if state:
            self._states[int(client_id)] = {n: {k: _own(v) for k, v in td.items()} for n, td in state.items()}

    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{"<client>/<state>/<param>": tensor}`` mapping."""
        flat: dict[str, Tensor] = {}
        for cid, state in self._states.items():
            flat.update(flatten_state(state, prefix=f"{cid}/"))
        return flat

    def load_state_dict(self, flat: dict[str, Tensor]) -> None:
        per_client: dict[int, dict[str, Tensor]] = {}
        for key, tensor in flat.items():
            cid, rest = key.split("/", 1)
            per_client.setdefault(int(cid), {})[rest] = tensor
        self._states = {cid: unflatten_state(f) for cid, f in per_client.items()}

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """What a checkpoint records of the store (here: every tensor)."""
        return self.state_dict()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)

    def equal(self, other: ClientStore) -> bool:
        """Bitwise equality of every client's every tensor."""
        a, b = self.state_dict(), other.state_dict()
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class DiskClientStore(ClientStore):
    """Client states in one safetensors file per client: resident memory independent of N.

    Only the round's active clients are read; each ``put`` atomically replaces the
    client's file. A checkpoint records a snapshot of the directory made of hard
    links (no data copied; files are never modified in place), and resuming from
    that checkpoint restores exactly that snapshot. The newest ``keep_snapshots``
    snapshots are kept.

    Args:
        directory: where the files live (created; must not hold another run's states).
        keep_snapshots: snapshots kept for resuming, >= 1.
    """

    def __init__(self, directory: str, keep_snapshots: int = 2) -> None:
        super().__init__()
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        self.directory = Path(directory)
        self.live = self.directory / "live"
        if self.live.exists() and any(self.live.iterdir()):
            raise ValueError(
                f"DiskClientStore directory {self.live} already holds client states; "
                "use an empty directory (a resume restores its snapshot from the checkpoint)"
            )
        self.live.mkdir(parents=True, exist_ok=True)
        self.keep_snapshots = keep_snapshots
        self._ids: set[int] = set()

    def _path(self, client_id: int) -> Path:
        return self.live / f"{int(client_id)}.safetensors"

    def __contains__(self, client_id: int) -> bool:
        return int(client_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def client_ids(self) -> list[int]:
        return sorted(self._ids)

    def get(self, client_id: int, init: StateInit) -> NestedState:
        from safetensors.torch import load_file

        if int(client_id) not in self._ids:
            return init()
        return unflatten_state(load_file(self._path(client_id)))

    def put(self, client_id: int, state: NestedState) -> None:
        from safetensors.torch import save_file

        if not state:
            return
        flat = {k: v.detach().cpu().clone().contiguous() for k, v in flatten_state(state).items()}
        tmp = self._path(client_id).with_suffix(".tmp")
        save_file(flat, str(tmp))
        os.replace(tmp, self._path(client_id))
        self._ids.add(int(client_id))

    def state_dict(self) -> dict[str, Tensor]:
        flat: dict[str, Tensor] = {}
        for cid in self.client_ids():
            flat.update(flatten_state(self.get(cid, dict), prefix=f"{cid}/"))
        return flat

    def load_state_dict(self, flat: dict[str, Tensor]) -> None:
        memory = ClientStore()
        memory.load_state_dict(flat)
        shutil.rmtree(self.live)
        self.live.mkdir()
        self._ids = set()
        for cid in memory.client_ids():
            self.put(cid, memory.get(cid, dict))

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        snapshots = self.directory / "snapshots"
        target = snapshots / f"step_{step:09d}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for cid in self._ids:
            os.link(self._path(cid), target / self._path(cid).name)
        for old in sorted(snapshots.iterdir())[: -self.keep_snapshots]:
            shutil.rmtree(old)
        return {"disk_snapshot": str(target.resolve())}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        if "disk_snapshot" not in state:  # a checkpoint of an in-memory store
            self.load_state_dict(state)
            return
        snapshot = Path(state["disk_snapshot"])
        if not snapshot.is_dir():
            raise FileNotFoundError(f"client-store snapshot {snapshot} of this checkpoint no longer exists")
        shutil.rmtree(self.live)
        self.live.mkdir()
        for file in snapshot.iterdir():
            os.link(file, self.live / file.name)
        self._ids = {int(f.stem) for f in snapshot.iterdir()}
