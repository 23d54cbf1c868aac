"""The model each client predicts with (docs/personalization.md, "Evaluation protocol"): the algorithm's
``personal_model`` of the client's stored state (25.1), then ``personalize_step`` (25.2); an unseen client's
after one local round of its own (a mixin of ``FederatedModule``)."""

from __future__ import annotations

import logging

import torch

from fl_lightning.algorithms import RoundInfo
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import derive_seed
from fl_lightning.core.tasks import PERSONAL, ClientState, ClientTask
from fl_lightning.reliability.faults import ClientError

log = logging.getLogger(__name__)
PERSONALIZE_STREAM = 0x9E25
"""Seed stream of evaluation's personalization (``personalize_step`` batches, an unseen client's local round)."""


class PredictionParams:
    """Of a module with ``algorithm``, ``local``, ``server_state``, ``global_params``, ``client_state``, ``runtime``."""

    def prediction_params(self, client_id: int) -> TensorDict:
        """The parameters training client ``client_id`` predicts with: the algorithm's ``personal_model`` of
        its stored state (25.1), then ``personalize_step`` (25.2)."""
        with torch.inference_mode(False), torch.enable_grad():  # evaluation runs under inference mode
            x = self.global_params()
            state = self.client_state(client_id, x)
            return self._personalized(client_id, self.algorithm.personal_model(x, state.algorithm, state.personal), state, x, self._evaluation_info())

    def unseen_prediction_params(self, client_id: int) -> TensorDict:
        """The parameters an unseen client predicts with: from its initial state it runs one round of the
        algorithm's local training on its own training split (seeded by (seed, client, round); nothing is
        uploaded, aggregated or stored), then ``personal_model`` and ``personalize_step`` as any client."""
        from fl_lightning.executors.sequential import run_task

        warned = self.__dict__.setdefault("_warned_unseen", set())
        if client_id in self.store and client_id not in warned:
            warned.add(client_id)
            log.warning("unseen_prediction_params(%d): client %d trained in this run; its personalization round starts "
                        "from its stored state, not the initial one (an unseen client's)", client_id, client_id)  # fmt: skip
        with torch.inference_mode(False), torch.enable_grad():
            x, data, info = self.global_params(), self.datamodule, self._evaluation_info()
            server_state = {n: {k: v.to(self.device) for k, v in td.items()} for n, td in (self.server_state or {}).items()}
            broadcast = self.algorithm.broadcast(x, server_state, info)
            initial = self.client_state(client_id, x)  # never trained: the algorithm's initial state, the model's personal values
            steps = data.num_local_steps(client_id, self.local.batch_size, self.local.steps, self.local.epochs)
            seed = derive_seed(data.seed, client_id, info.round, PERSONALIZE_STREAM)
            result = run_task(ClientTask(client_id, seed, steps, broadcast, lambda: initial), info, self.runtime(private=False))
            if result is None:
                raise ClientError(f"unseen client {client_id} failed its personalization round; see the warning above")
            state = dict(result.client_state)
            personal = state.pop(PERSONAL, initial.personal)
            return self._personalized(client_id, self.algorithm.personal_model(x, state, personal), ClientState(state, personal), x, info)

    def _evaluation_info(self) -> RoundInfo:
        """The facts of the last completed round, for rules run at evaluation."""
        return self.round_info(max(self.global_step - 1, 0), None, personal=True)

    def _personalized(self, client_id: int, params: TensorDict, state: ClientState, x: TensorDict, info: RoundInfo) -> TensorDict:
        """``algorithm.personalize_step`` run ``personalize_steps`` times on the client's training batches (25.2)."""
        if not self.algorithm.personalize_steps:
            return params
        from fl_lightning.executors.sequential import personalize_client

        seed = derive_seed(self.datamodule.seed, client_id, PERSONALIZE_STREAM)
        return personalize_client(params, client_id, seed, state, x, info, self.runtime(private=False))
