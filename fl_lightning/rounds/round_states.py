"""The round's client states as stacked tables (``StateTable``), and the write-back of a round's new states.

A batched round reads its clients' states with one ``ClientStore.gather`` and the round's new states
go back with one ``ClientStore.scatter``: one indexed op per tensor, not one ``get``/``put`` per client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import ClientStore, NestedState
from fl_lightning.core.round_results import RoundResults, same_tensors
from fl_lightning.core.tasks import PERSONAL, ClientResult, ClientState


@dataclass(frozen=True)
class RoundStates:
    """``StateTable`` of a round: the values of ``FederatedModule.client_state`` for many clients at once.

    Args:
        store: the client store.
        init: the algorithm's initial client state (for the round's x).
        personal: the model's initial personal tensors ({} without personal tensors).
        device: where the clients' tensors live.
        is_message_state: whether a state name is a message stage's (read separately, never by the rule).
    """

    store: ClientStore
    init: Callable[[], NestedState]
    personal: Callable[[], TensorDict]
    device: torch.device
    is_message_state: Callable[[str], bool]

    def gather(self, ids: Tensor) -> ClientState | None:
        initial = self.init()
        personal = self.personal()
        held = self.store.entries()
        wanted = {(n, k) for n, td in initial.items() for k in td}
        if held is not None and not {e for e in held if e[0] != PERSONAL and not self.is_message_state(e[0])} <= wanted:
            return None  # some client holds an entry its initial state lacks: client by client, as stored
        stacked = self.store.gather(ids, lambda: {**initial, PERSONAL: personal} if personal else initial)
        own = stacked.pop(PERSONAL, {})
        on_device = {n: {k: v.to(self.device) for k, v in td.items()} for n, td in stacked.items()}
        return ClientState(on_device, {k: v.to(self.device) for k, v in own.items()})


def store_results(store: ClientStore, results: Sequence[ClientResult]) -> None:
    """Each result's new client state into the store (as ``put`` client by client), in one ``scatter``
    where every state holds the same tensors' shapes and dtypes (stacked results: their stacked states)."""
    results = RoundResults.of(results)
    stacked = results.stacked_states
    if stacked is not None:
        if any(stacked.values()):
            store.scatter(torch.tensor(results.client_ids, dtype=torch.int64), {n: {k: v.detach() for k, v in td.items()} for n, td in stacked.items()})
        return
    states = [r.client_state for r in results]
    if len(states) > 1 and states[0] and all(same_tensors(states[0], s) for s in states[1:]):
        ids = torch.tensor([r.client_id for r in results], dtype=torch.int64)
        store.scatter(ids, {n: {k: _stacked([s[n][k] for s in states]) for k in td} for n, td in states[0].items()})
        return
    for result in results:
        store.put(result.client_id, result.client_state)


def _stacked(tensors: list[Tensor]) -> Tensor:
    """``torch.stack(tensors)``; without a copy where they are the rows of one stacked tensor, in order
    (a batched round's new states: views of its stacked result)."""
    first = tensors[0].detach()
    if len(tensors) > 1:
        step = tensors[1].storage_offset() - first.storage_offset()
        storage = first.untyped_storage().data_ptr()
        if step > 0 and all(
            t.untyped_storage().data_ptr() == storage and t.storage_offset() == first.storage_offset() + i * step and t.stride() == first.stride()
            for i, t in enumerate(tensors)
        ):
            return first.as_strided((len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())
    return torch.stack([t.detach() for t in tensors])
