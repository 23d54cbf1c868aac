"""What the compiled round (``fl_lightning/executors/round_program.py``) needs of the engine: the server optimizer's
pure step with the global model and server state, and the commit of what the round's program computed."""

from __future__ import annotations

from typing import Any

from fl_lightning.core.params import TensorDict
from fl_lightning.core.state import NestedState


class CompiledRoundHost:
    """``FederatedModule``'s part of the compiled round (``RoundHost.server_inputs`` and ``commit_round``)."""

    def server_inputs(self, x: TensorDict, server_state: NestedState, weights: Any) -> Any:
        """What the compiled round needs of the server (``ServerInputs``), or why its optimizer has no pure form."""
        from fl_lightning.executors.round_program import ServerInputs
        from fl_lightning.optim.functional import functional_step

        optimizer = self.optimizers().optimizer
        if getattr(self, "_functional", (None,))[0] is not optimizer:  # once per optimizer
            self._functional = (optimizer, functional_step(optimizer))
        step = self._functional[1]
        return step if isinstance(step, str) else ServerInputs(x, server_state, weights, step)

    def commit_round(self, compiled: Any) -> None:
        """A compiled round's new x and optimizer state, written back; the optimizer steps with every ``.grad`` None
        first (nothing moves), so that Lightning counts the round as it counts ``apply_update``'s."""
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        compiled.commit()
