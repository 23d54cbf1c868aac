"""Persistent tensors that outlive a round: per-client state and server state.

Ownership: algorithms *declare* state (names and initial values); the
``FederatedModule`` is the only writer; the store travels in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

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
            self._states[int(client_id)] = {n: {k: v.detach() for k, v in td.items()} for n, td in state.items()}

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

    def equal(self, other: ClientStore) -> bool:
        """Bitwise equality of every client's every tensor."""
        a, b = self.state_dict(), other.state_dict()
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
