"""Each client's stored state as the round and evaluation read it: the algorithm's state, the message
stages' state and the personal tensors (a mixin of ``FederatedModule``, which owns ``store``)."""

from __future__ import annotations

from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState
from fl_lightning.core.tasks import PERSONAL, ClientState
from fl_lightning.pipeline.messages import is_message_state


class ClientStates:
    """Reads of the client store on the module's device (``store``, ``algorithm``, ``model``, ``personal_names``, ``device``)."""

    def client_state(self, client_id: int, x: TensorDict) -> ClientState:
        """Client ``client_id``'s stored state on this device: the algorithm's (its declared
        initial state if it never trained) and its personal tensors."""
        stored = self.store.get(client_id, lambda: self.algorithm.client_state_init(x))
        state = {
            n: {k: v.to(self.device) for k, v in td.items()} for n, td in stored.items() if n != PERSONAL and not is_message_state(n)
        }
        return ClientState(state, self._personal(stored))

    def message_state(self, client_id: int) -> NestedState:
        """Client ``client_id``'s stored message-stage state (``fl_lightning.pipeline.messages``), on this device."""
        stored = self.store.get(client_id, dict)
        return {n: {k: v.to(self.device) for k, v in td.items()} for n, td in stored.items() if is_message_state(n)}

    def client_personal(self, client_id: int) -> TensorDict:
        """Client ``client_id``'s personal tensors v_i ({} if the model has none)."""
        return self._personal(self.store.get(client_id, dict))

    def _personal(self, stored: NestedState) -> TensorDict:
        """The personal tensors in a stored state; the model's initial values for a client that never trained."""
        if not self.personal_names:
            return {}
        values = stored.get(PERSONAL)
        if values is None:
            values = self.initial_personal()
        return {k: v.to(self.device) for k, v in values.items()}

    def initial_personal(self) -> TensorDict:
        """The model's values of the personal tensors: those of a client that never trained ({} without any)."""
        named = dict(self.model.named_parameters()) if self.personal_names else {}
        return {n: named[n].detach() for n in self.personal_names}
