"""FederatedModule: one Lightning training step = one federated round."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from fl_lightning.reliability import csv_resume, fingerprint
from fl_lightning.core import params as P
from fl_lightning.adversary import Attack
from fl_lightning.adversary.base import split_batch
from fl_lightning.adversary.executor import AttackExecutor
from fl_lightning.algorithms import Algorithm, FedAvg, RoundInfo
from fl_lightning.algorithms.base import declares_capability
from fl_lightning.core.client_data import ClientData
from fl_lightning.clock import SimClock
from fl_lightning.clock.asynchronous import AsyncAggregation
from fl_lightning.clock.events import EventQueue
from fl_lightning.engine.async_step import AsyncServer
from fl_lightning.compression.stages import Compression
from fl_lightning.core.config import MAX_LOCAL_STEPS, LocalTraining
from fl_lightning.core.errors import CheckpointError
from fl_lightning.executors import ClientRuntime, Executor, resolve_executor
from fl_lightning.reliability.faults import ClientError, ClientFaults, DivergenceError, all_finite, first_non_finite, survivor_weights
from fl_lightning.core.local_loss import check_label_counts, check_local_loss
from fl_lightning.engine.round_states import RoundStates, store_results
from fl_lightning.pipeline.messages import MessageExecutor, MessagePipeline, Stage, add_sums, is_message_state, upload_like
from fl_lightning.core.metrics import consistency_from_sums, count_messages, loss_term_means, payload_bytes, round_metrics
from fl_lightning.core.objective import Objective
from fl_lightning.lora import LoRAAggregation
from fl_lightning.lora.server import lora_server
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.pipeline.record_privacy import RecordPrivacy
from fl_lightning.robust.aggregation import Robust
from fl_lightning.robust.record import KeptRecord
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import RoundPlan, derive_seed, derive_seeds
from fl_lightning.core.state import ClientStore, NestedState, flatten_state, unflatten_state
from fl_lightning.core.round_results import RoundResults
from fl_lightning.core.tasks import PERSONAL, ClientState, ClientTask, Payload, RoundTasks, SummedRound, TaskColumns

log = logging.getLogger(__name__)
_CKPT_KEY = "federated"
LOSS_GROWTH_WARNING = 100.0
"""A round's mean training loss this many times the first round's is reported (once per run)."""
WARMUP_STREAM = 0x3A4D
"""Seed stream of the warm-up pass: its samples xi^{-1} are fresh and addressable by client."""
PERSONALIZE_STREAM = 0x9E25
"""Seed stream of evaluation's personalization (``personalize_step`` batches, an unseen client's local round)."""


def quiet_known_warnings() -> None:
    """Silence Lightning warnings that do not apply to a round loop.

    The round-plan loader does no data work (workers would not help), and a
    checkpoint taken after the server step is exactly the state to resume from.
    """
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")
    warnings.filterwarnings("ignore", message=".*overridden `transfer_batch_to_device` in `LightningModule`.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    # Under DDP every rank aggregates the same uploads and logs the same round metrics: nothing to sync.
    warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")


def _local_steps(data, clients: list[int], local) -> list[int]:
    """Each client's K: the data's ``clients_num_local_steps`` (all at once) where it has one, else client by client."""
    many = getattr(data, "clients_num_local_steps", None)
    if many is not None:
        return many(clients, local.batch_size, local.steps, local.epochs)
    return [data.num_local_steps(c, local.batch_size, local.steps, local.epochs) for c in clients]


class FederatedModule(AsyncServer, L.LightningModule):
    """Owns the global model, the server state, the client store and the round loop.

    Each training step receives a ``RoundPlan`` from the datamodule, broadcasts,
    runs the active clients' local training, aggregates, and lets the server
    optimizer apply the pseudo-gradient (so ``trainer.max_steps`` counts rounds
    and the server optimizer state is checkpointed by Lightning).

    Args:
        model: the network; its trainable parameters not matched by ``personal``
            are the federated tensors.
        algorithm: the federated algorithm (default FedAvg).
        local: local training settings.
        personal: glob patterns of parameter names, or module paths (``"head"``),
            kept per client and never sent. Each client's values are client state in
            ``store`` (initialised from the model's values) and are trained by
            algorithms with ``supports_personal`` (FedAvgP, ScaffoldP, FedSim, FedAlt).
        execution: how the round's client tasks run: ``"sequential"`` (one after
            another), ``"batched"`` (together, with torch.func.vmap; same results to
            float tolerance, sequential for declared reasons such as BatchNorm), or any
            ``fl_lightning.executors.Executor`` (``class_path`` in YAML). Under DDP the
            executor is wrapped to split the tasks over the processes.
        store: where per-client state lives: in memory (default) or a
            ``DiskClientStore`` for large populations.
        faults: simulated client dropout, stragglers and failure handling.
        uplink: message stages on the clients' uploads (``fl_lightning.pipeline.messages``: clip, compress,
            noise); default none.
        downlink: message stages on the broadcast; default none.
        privacy: client-level differential privacy (``fl_lightning.pipeline.privacy.ClientPrivacy``): contributes
            its clip and noise stages to the uplink and logs ``privacy/epsilon``.
        compression: compressors of the uploads and of the broadcast, with error feedback
            (``fl_lightning.compression.Compression``, docs/compression.md); default none.
        record_privacy: record-level DP-SGD in local training (``fl_lightning.pipeline.record_privacy.RecordPrivacy``,
            docs/privacy.md): per-example clipping and Gaussian noise in every local step; logs
            ``privacy/record_epsilon``. Composes with ``privacy`` and ``compression``.
        clock: simulated time (``fl_lightning.clock.SimClock``, docs/time.md): each client's speed, bandwidth
            and availability; rounds wait for their slowest client or a deadline; logs ``time/sim_s``.
        asynchronous: FedBuff or FedAsync (``fl_lightning.clock.AsyncAggregation``, docs/time.md) under the
            clock: one training step is one server update from the buffered arrivals.
        robust: Byzantine-robust aggregation (``fl_lightning.robust.Robust``, docs/robustness.md): the
            rule's combination of the round's uploads replaces their weighted mean; default none.
        attack: malicious clients poisoning their data or their uploads (``fl_lightning.adversary.Attack``,
            docs/robustness.md, "Attacks"): uploads are attacked after the round's training, before the message
            stages; logs ``attack/*`` (``attack/backdoor_asr`` at every evaluation with a backdoor).
        lora_aggregation: how the server aggregates LoRA adapters (``fl_lightning.lora``, docs/algorithms.md 28):
            ``factors`` (FedIT), ``stacked`` (FLoRA), ``exact_residual`` (FedEx-LoRA), ``svd`` (FlexLoRA),
            ``zero_pad`` (HetLoRA), ``share_a`` (FedSA-LoRA), or such a method with heterogeneous ``ranks``;
            ``None`` (default): the algorithm's own aggregate of the factors, and nothing of it runs.
    """

    def __init__(
        self,
        model: nn.Module,
        algorithm: Algorithm | None = None,
        local: LocalTraining = LocalTraining(),
        personal: list[str] | None = None,
        execution: str | Executor = "sequential",
        store: ClientStore | None = None,
        faults: ClientFaults = ClientFaults(),
        uplink: list[Stage] | None = None,
        downlink: list[Stage] | None = None,
        privacy: ClientPrivacy | None = None,
        compression: Compression | None = None,
        record_privacy: RecordPrivacy | None = None,
        clock: SimClock | None = None,
        asynchronous: AsyncAggregation | None = None,
        robust: Robust | None = None,
        attack: Attack | None = None,
        lora_aggregation: str | LoRAAggregation | None = None,
    ) -> None:
        super().__init__()
        quiet_known_warnings()
        self.automatic_optimization = False
        self.model = model
        self.algorithm = algorithm if algorithm is not None else FedAvg()
        self.local = local if local is not None else LocalTraining()
        self.personal = list(personal or [])
        self.federated_names = P.federated_names(model, self.personal)
        if not self.federated_names:
            raise ValueError("the model has no trainable parameters left to federate (check `personal` patterns)")
        self.personal_names = P.personal_names(model, self.personal)
        if self.personal_names and not self.algorithm.supports_personal:
            raise ValueError(
                f"personal={self.personal} selects {self.personal_names} but algorithm "
                f"{type(self.algorithm).__name__} does not train personal tensors; use FedAvgP, FedSim, ScaffoldP or FedAlt"
            )
        check_local_loss(self.algorithm, model)
        self.store = store if store is not None else ClientStore()
        self.faults = faults
        self.server_state: NestedState | None = None
        self.executor = resolve_executor(execution)
        self.privacy = privacy
        self.record_privacy = record_privacy
        self.compression = compression
        self.robust = robust
        if robust is not None and privacy is not None:  # before compression's: a selecting rule is the first reason
            robust.check_with_privacy()
        self._robust_round = None  # the last round's RoundOutcome (its metrics and kept clients are logged)
        self._root_data = None  # (datamodule, FLTrust's RootData drawn from it)
        compress_up, compress_down = compression.stages() if compression is not None else ([], [])
        if compression is not None:
            named = dict(model.named_parameters())
            shapes = {n: named[n].shape for n in self.federated_names}
            compression.check_shapes(shapes)
            compression.warn_feedback(shapes)  # an explicit error_feedback_up: true with an unbiased compressor
            if privacy is not None:
                compression.check_with_privacy()
        self.messages = MessagePipeline(
            [*(uplink or []), *(privacy.stages() if privacy is not None else []), *compress_up], [*(downlink or []), *compress_down]
        )
        self.attack = attack
        if attack is not None:  # inside the message stages: compression, clipping and noise see what the attacker sends
            self.executor.inner = AttackExecutor(self.executor.inner, attack)
        if self.messages.client_stages:  # inside the DDP wrapper: each process transforms its own clients' uploads
            self.executor.inner = MessageExecutor(self.executor.inner, self.messages)
        self.objective = Objective(model, self.federated_names + self.personal_names)
        self.clock, self.asynchronous = clock, asynchronous
        if asynchronous is not None:
            asynchronous.check(self.algorithm, clock, privacy, record_privacy, self.messages, self.personal_names, faults)
        self._events = EventQueue() if asynchronous is not None else None  # clients in flight and their model versions
        self.sim_time = 0.0  # simulated seconds since the run began (with a clock)
        self._upload_size: int | None = None  # the clock's nominal upload bytes (fl_lightning/clock/sizes.py)
        self.lora = lora_server(lora_aggregation, model, self.federated_names, self.personal_names, self.algorithm, privacy)
        self._checked_data = None
        self._schema: dict[str, Any] | None = None  # the fingerprint's algorithm and model part (fixed)
        self._partition: tuple[Any, str] | None = None  # (datamodule, its partition's digest)
        self._resumed_step: int | None = None  # the global step of the checkpoint this fit resumed from
        self._rounds_run, self._clients_trained = 0, 0  # this fit's, for "a run that trained nothing fails"
        self._first_loss: float | None = None  # the first round's mean training loss (divergence by growth)
        self._growth_reported = False
        self.comm_totals = {"bytes_up": 0, "bytes_down": 0, "client_uploads": 0}
        self.val_loss, self.val_acc = MeanMetric(), MeanMetric()
        self.test_loss, self.test_acc = MeanMetric(), MeanMetric()
        if attack is not None and attack.backdoor is not None:
            self.val_asr, self.test_asr = MeanMetric(), MeanMetric()

    # ---- wiring -------------------------------------------------------------------------
    @property
    def datamodule(self) -> ClientData:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not self._checked_data:  # a structural check costs microseconds per member: once per datamodule
            if not isinstance(datamodule, ClientData):
                raise RuntimeError("FederatedModule needs a FederatedDataModule passed as `datamodule=` to the Trainer")
            self._checked_data = datamodule
        return datamodule

    def federated_parameters(self) -> list[nn.Parameter]:
        # Read through the objective's resolved (module, attribute) slots: walking named_parameters()
        # of a large model (a peft-wrapped GPT-2) costs about a millisecond, several times a round.
        slots = self.objective.swap.slots
        return [module._parameters[attr] for module, attr in (slots[n] for n in self.federated_names)]

    def global_params(self) -> TensorDict:
        """The global federated tensors x (detached views of the live parameters)."""
        return {n: p.detach() for n, p in zip(self.federated_names, self.federated_parameters())}

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
            values = self._initial_personal()
        return {k: v.to(self.device) for k, v in values.items()}

    def _initial_personal(self) -> TensorDict:
        """The model's values of the personal tensors: those of a client that never trained ({} without any)."""
        named = dict(self.model.named_parameters()) if self.personal_names else {}
        return {n: named[n].detach() for n in self.personal_names}

    def setup(self, stage: str) -> None:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from fl_lightning.reliability.checkpoint_io import StreamingCheckpointIO

        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and type(strategy.checkpoint_io) is TorchCheckpointIO:  # not a user's own
            strategy.checkpoint_io = StreamingCheckpointIO()  # streamed, beside the checkpoint (fl_lightning/reliability/checkpoint_io.py)
        check_data = getattr(self.model, "check_data", None)
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if callable(check_data) and data is not None:
            check_data(data)  # e.g. sequences longer than a language model's positions: one line, before anything runs
        if self.server_state is None:
            self.server_state = self.algorithm.server_state_init(P.detach_clone(self.global_params()))

    def on_fit_start(self) -> None:
        if self.trainer.max_steps is None or self.trainer.max_steps < 1:
            raise ValueError(f"trainer.max_steps is the number of rounds and must be >= 1, got {self.trainer.max_steps}")
        interval = self.trainer.val_check_interval
        if interval is not None and not interval > 0:
            raise ValueError(
                f"trainer.val_check_interval must be > 0 (rounds between evaluations, or a fraction in (0, 1]), got {interval}"
            )
        self._check_local_work()
        self.algorithm.check_local(self.local)
        if self.asynchronous is not None:
            self.asynchronous.check_population(self.datamodule.num_clients)
        check_label_counts(self.algorithm, self.datamodule)
        if self.messages:
            self.messages.check(self.algorithm, self.datamodule.num_clients)
        if self.robust is not None:
            self.robust.check(self.algorithm, self._cohort())
            if self.robust.needs_reference and self.personal_names:
                raise ValueError("robust.rule=fltrust with personal tensors: the server's root update has no personal part; use another rule")
            if self.global_rank == 0:
                KeptRecord(self._run_dir()).start(self._resumed_step or 0)
        if self.attack is not None:  # refusals, then the malicious set drawn from data.seed
            data = self.datamodule
            self.attack.prepare(data.num_clients, data.seed, getattr(data, "num_classes", None), self.algorithm,
                                self.trainer.world_size, self.record_privacy is not None)  # fmt: skip
            self.attack.check_data(data)
            if self.robust is not None:  # the defence's norms split into benign and malicious uploads
                self.robust.mark_malicious(set(self.attack.malicious.ids))
        if self.privacy is not None:  # the sampling scheme, sigma (calibrated if asked), the accountant
            participation = getattr(self.datamodule, "participation", None)
            self.privacy.prepare(participation, self.datamodule.num_clients, self.trainer.max_steps, self.datamodule.seed)
        if self.record_privacy is not None:  # refusals, each client's sampling rate, the accountant (restored on resume)
            self.record_privacy.check(self.algorithm, self.model, self.datamodule, self.local)
            self.record_privacy.prepare(self.datamodule, self.local)
        if self.global_rank == 0:  # temporary files of killed checkpoint writes
            from fl_lightning.reliability.checkpoint_io import remove_stale_temporaries

            for path in remove_stale_temporaries(c.dirpath for c in self.trainer.checkpoint_callbacks if getattr(c, "dirpath", None)):
                log.info("removed %s, left by a checkpoint write that did not finish", path)
        self.store.start()
        place = getattr(self.datamodule, "place", None)
        if callable(place):  # client data resident on the training device, copied there once
            place(self.device)
        if self._resumed_step is not None and self._resumed_step >= self.trainer.max_steps:
            raise ValueError(
                f"the checkpoint {self.trainer.ckpt_path} already holds {self._resumed_step} rounds, at or past "
                f"--trainer.max_steps {self.trainer.max_steps}: nothing to train; raise --trainer.max_steps above "
                f"{self._resumed_step} to continue it, or evaluate it with `fl-lightning test --ckpt_path ...`"
            )
        if self._resumed_step is not None:
            self._continue_metrics(self._resumed_step)
        elif self.global_rank == 0 and getattr(self, "_previous_metrics", None):
            csv_resume.replaced(self._previous_metrics)
        self._previous_metrics = {}
        if self.global_rank == 0:
            csv_resume.guard(self.loggers)  # a full or read-only metrics folder: one line naming it

    def _check_local_work(self) -> None:
        """At most ``MAX_LOCAL_STEPS`` local steps per client and round, before any training
        (``local.steps`` is checked when LocalTraining is built; epochs need the client sizes)."""
        local, data = self.local, self.datamodule
        if local.epochs is None:
            return
        steps = [data.num_local_steps(c, local.batch_size, None, local.epochs) for c in range(data.num_clients)]
        largest = max(range(len(steps)), key=steps.__getitem__)
        if steps[largest] > MAX_LOCAL_STEPS:
            raise ValueError(
                f"local.epochs={local.epochs} gives {steps[largest]} local steps per round for client {largest} "
                f"({int(data.client_sizes[largest])} samples, batch_size={local.batch_size}); "
                f"must be <= {MAX_LOCAL_STEPS} (lower local.epochs or raise local.batch_size)"
            )

    def prepare_data(self) -> None:
        self._previous_metrics = csv_resume.read(self.loggers)  # before Lightning's CSV writer deletes them

    def _continue_metrics(self, step: int) -> None:
        if self.global_rank == 0:
            csv_resume.continue_from(self.loggers, getattr(self, "_previous_metrics", None) or {}, step)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if self._privacy_budget_spent():  # a run resumed with its budget spent: no round to run (it was evaluated then)
            return -1
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._release_snapshots()  # the checkpoint callbacks (run before this hook) have written their files
        more = self.trainer.max_steps < 0 or self.trainer.global_step < self.trainer.max_steps
        if more:  # a stop requested here, after the round, lets Lightning validate the final model (as early stopping does)
            self._privacy_budget_spent()

    def _privacy_budget_spent(self) -> bool:
        """privacy.budget="stop": whether one more round would spend more than target_epsilon; if so the run
        stops (``trainer.should_stop``), saying so in one line."""
        if self.privacy is None or self.trainer.should_stop or not self.privacy.budget_exhausted():
            return False
        log.warning(
            "privacy: stopping after %d rounds: one more would spend more than target_epsilon=%g",
            self.privacy.accountant.rounds, self.privacy.target_epsilon,
        )  # fmt: skip
        self.trainer.should_stop = True
        return True

    def on_validation_end(self) -> None:
        self._release_snapshots()

    def _release_snapshots(self) -> None:
        self.store.release_snapshots([str(c.dirpath) for c in self.trainer.checkpoint_callbacks if getattr(c, "dirpath", None)])

    def on_train_end(self) -> None:
        self._release_snapshots()
        if self._rounds_run and not self._clients_trained:
            raise ClientError(
                f"no client completed its local training in {self._rounds_run} rounds: the model is untrained; "
                "see the warnings above for the clients' errors"
            )

    def configure_callbacks(self) -> list[L.Callback]:
        from fl_lightning.engine.personal_eval import PersonalizedEvaluation
        from fl_lightning.reliability.stopping import StopCheckpoint

        callbacks: list[L.Callback] = [StopCheckpoint()]  # SIGTERM/SIGINT end the run with a checkpoint of the last completed round
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if getattr(data, "holdout_fraction", 0) > 0:  # every run with per-client held-out data scores each client's own model
            callbacks.append(PersonalizedEvaluation())  # (replaces one configured in trainer.callbacks: no double logging)
        return callbacks

    # ---- the model each client predicts with (docs/personalization.md, "Evaluation protocol") ------------
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

        with torch.inference_mode(False), torch.enable_grad():
            x, data, info = self.global_params(), self.datamodule, self._evaluation_info()
            server_state = {n: {k: v.to(self.device) for k, v in td.items()} for n, td in (self.server_state or {}).items()}
            broadcast = self.algorithm.broadcast(x, server_state, info)
            initial = self.client_state(client_id, x)  # never trained: the algorithm's initial state, the model's personal values
            steps = data.num_local_steps(client_id, self.local.batch_size, self.local.steps, self.local.epochs)
            seed = derive_seed(data.seed, client_id, info.round, PERSONALIZE_STREAM)
            result = run_task(ClientTask(client_id, seed, steps, broadcast, lambda: initial), info, self._runtime(private=False))
            if result is None:
                raise ClientError(f"unseen client {client_id} failed its personalization round; see the warning above")
            state = dict(result.client_state)
            personal = state.pop(PERSONAL, initial.personal)
            return self._personalized(client_id, self.algorithm.personal_model(x, state, personal), ClientState(state, personal), x, info)

    def _evaluation_info(self) -> RoundInfo:
        """The facts of the last completed round, for rules run at evaluation."""
        round_idx = max(self.global_step - 1, 0)
        return RoundInfo(round_idx, self.local.lr_at(round_idx), self.datamodule.num_clients, None, self._personal_lr(round_idx))

    def _personal_lr(self, round_idx: int) -> float | None:
        """gamma_v of the round: with personal tensors, or a ``local.personal_lr`` a rule reads (Ditto's v_i); else None."""
        return self.local.personal_lr_at(round_idx) if self.personal_names or self.local.personal_lr is not None else None

    def _personalized(self, client_id: int, params: TensorDict, state: ClientState, x: TensorDict, info: RoundInfo) -> TensorDict:
        """``algorithm.personalize_step`` run ``personalize_steps`` times on the client's training batches (25.2)."""
        if not self.algorithm.personalize_steps:
            return params
        from fl_lightning.executors.sequential import personalize_client

        seed = derive_seed(self.datamodule.seed, client_id, PERSONALIZE_STREAM)
        return personalize_client(params, client_id, seed, state, x, info, self._runtime(private=False))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.algorithm.server_optimizer(self.federated_parameters())

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, RoundPlan):  # client ids and seeds stay on the CPU: they index CPU-side data
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # ---- one round ------------------------------------------------------------------------
    def training_step(self, plan: RoundPlan, batch_idx: int) -> None:
        self._round_started = time.perf_counter()
        if self.asynchronous is not None:
            return self._async_step(plan)
        info = RoundInfo(plan.round, self.local.lr_at(plan.round), self.datamodule.num_clients, plan, self._personal_lr(plan.round))
        x = self.global_params()
        server_state = {n: {k: v.to(self.device) for k, v in td.items()} for n, td in self.server_state.items()}
        if self.algorithm.warmup_pass and plan.round == 0:
            server_state = self._warmup(x, server_state, info)
        broadcast = self.algorithm.broadcast(x, server_state, info)
        broadcast_bytes = None
        if self.messages:  # the message pipeline's round (fl_lightning/pipeline/messages.py); absent: nothing of it runs
            self.messages.begin_round(info)
            if self.messages.broadcast_stages:
                broadcast, broadcast_bytes = self.messages.transform_broadcast(broadcast, info, self.datamodule.seed)
        times = self._plan_times(plan, x, broadcast, broadcast_bytes) if self.clock is not None else None
        tasks, stragglers = self._tasks(plan.clients.tolist(), plan.seeds.tolist(), broadcast, plan.round, allowed=times and times.allowed)
        if self.lora is not None and self.lora.method.needs_clients:  # the factors the clients start from (after downlink stages)
            x_round = P.detach_clone(broadcast["x"])
        # An algorithm whose aggregate is a sum over clients may get the uploads summed (DDP:
        # partial sums all-reduced, not gathered); any other, or one process, gets every upload.
        # Robust aggregation and LoRA methods that read each client's factors need every upload in one place.
        linear = (
            declares_capability(self.algorithm, "linear_aggregate")
            and self.robust is None
            and (self.lora is None or not self.lora.reads_clients)
        )
        weights = self.messages.aggregation_weights(info)  # an aggregate stage's fixed weights, or None: the plan's
        if weights is None:
            weights = functools.partial(survivor_weights, plan.clients, plan.weights)
        runtime = self._runtime(weights if linear else None)
        try:
            summed = self.executor.run_summed(tasks, info, runtime) if linear else None
            results = RoundResults.of(summed.results if summed is not None else self.executor.run(tasks, info, runtime))
        except DivergenceError as error:  # a client's loss (the built-in executors check it)
            raise self._diverged(str(error)) from error
        if self.record_privacy is not None:  # every dispatched task's K_i: the steps that touched its records
            extra_record = self.record_privacy.account(tasks.columns.client_ids, tasks.columns.num_steps)
        self.faults.check_failures(plan.round, len(tasks) - len(results), len(tasks))
        self._rounds_run, self._clients_trained = self._rounds_run + 1, self._clients_trained + len(results)
        extra_metrics = {"faults/dropped": len(plan.clients) - len(tasks), "faults/failed": len(tasks) - len(results)}
        if self.faults.active:
            extra_metrics["faults/stragglers"] = stragglers
        if self.attack is not None:
            extra_metrics.update(self.attack.round_metrics())
        if self.record_privacy is not None:
            extra_metrics.update(extra_record)
        if times is not None:
            extra_metrics.update(self._advance_clock(times, results, summed, broadcast, broadcast_bytes))
        if not results:
            self._empty_round(plan, broadcast, extra_metrics)
            return
        if self.lora is not None and self.lora.heterogeneous:  # a rank-r_i client sends its factors' first r_i components
            for result in results:
                result.upload = self.lora.mask_upload(result.upload, result.client_id)
        losses = results.mean_losses
        if any(map(math.isinf, losses)):  # any executor's: NaN may also mean "no loss recorded", infinity may not
            client, loss = next((c, loss) for c, loss in zip(results.client_ids, losses) if math.isinf(loss))
            raise self._diverged(f"round {plan.round}: client {client}'s training loss is non-finite ({loss})")
        self._check_loss_growth(plan.round, losses)
        too_few = self.robust.violation(len(results)) if self.robust is not None else None
        if too_few is not None:  # dropouts or failures left fewer clients than the rule's assumption on f
            log.warning("round %d: skipped (nothing aggregated, no client state kept): %s", plan.round, too_few)
            self._empty_round(plan, broadcast, {**extra_metrics, "robust/skipped": 1})
            return
        local_steps = results.num_steps
        if summed is not None:
            uploads, (pseudo_grad, self.server_state) = [], self._aggregate_summed(plan, x, summed, server_state, info, local_steps)
        else:
            uploads = results.uploads
            pseudo_grad, self.server_state = self._aggregate(plan, x, results, server_state, info, local_steps)
        extra_metrics.update({f"algo/{k}": v for k, v in self.algorithm.metrics(self.server_state, info).items()})
        if self._robust_round is not None:
            extra_metrics.update(self._robust_round.metrics)
            if self._robust_round.kept is not None and self.global_rank == 0:
                KeptRecord(self._run_dir()).add(plan.round, self._robust_round.kept)
        if self.messages:
            extra_metrics.update(self.messages.end_round(info, len(results)))
        store_results(self.store, results)

        optimizer = self.optimizers()  # no zero_grad: the pseudo-gradient replaces every parameter's .grad
        for name, param in zip(self.federated_names, self.federated_parameters()):
            param.grad = pseudo_grad[name].to(param.dtype)
        optimizer.step()
        if self.lora is not None and self.lora.method.needs_clients:  # the method's new factors and fold (fl_lightning/lora)
            ids = results.client_ids
            weights = survivor_weights(plan.clients, plan.weights, ids)
            extra_metrics["comm/round_bytes_fold"] = self.lora.finish_round(
                x_round, list(P.part(results.uploads, "delta")), ids, weights, self.datamodule.seed, plan.round
            )
        bad = None if all_finite([{"x": self.global_params()}]) else first_non_finite({"x": self.global_params()})
        if bad is not None:
            raise self._diverged(f"round {plan.round}: the global model became non-finite ({bad})")
        self._log_round(plan, broadcast, uploads, results, extra_metrics, summed, broadcast_bytes)

    # ---- simulated time (fl_lightning/clock, docs/time.md) ------------------------------------------
    def _bytes_down(self, broadcast: Payload, broadcast_bytes: int | None) -> int:
        return payload_bytes(broadcast) if broadcast_bytes is None else broadcast_bytes

    def _nominal_upload(self, x: TensorDict) -> int:
        if self._upload_size is None:
            from fl_lightning.clock.sizes import nominal_upload_bytes

            self._upload_size = nominal_upload_bytes(self.algorithm, x, self.compression)
        return self._upload_size

    def _plan_times(self, plan: RoundPlan, x: TensorDict, broadcast: Payload, broadcast_bytes: int | None):
        """Each selected client's online time and the steps it may run before the deadline (27.4)."""
        from fl_lightning.clock.rounds import plan_round

        data, local = self.datamodule, self.local
        clients = plan.clients.tolist()
        steps = _local_steps(data, clients, local)
        devices = self.clock.devices(data.num_clients)
        return plan_round(self.clock, devices, self.sim_time, clients, steps, self._bytes_down(broadcast, broadcast_bytes), self._nominal_upload(x))

    def _advance_clock(self, times, results, summed, broadcast: Payload, broadcast_bytes: int | None) -> dict[str, float]:
        """Move the clock to the round's end (27.4) from the bytes each reporting client actually sent."""
        from fl_lightning.clock.rounds import round_end

        sizes = summed.upload_bytes if summed is not None else results.upload_bytes
        cut, missed = times.cut, times.missed
        reported = list(zip(results.client_ids, results.num_steps, sizes))
        devices = self.clock.devices(self.datamodule.num_clients)
        self.sim_time = round_end(self.clock, devices, self.sim_time, times, reported, self._bytes_down(broadcast, broadcast_bytes), bool(cut or missed))
        metrics = {"time/sim_s": self.sim_time}
        if self.clock.deadline is not None:
            metrics.update({"faults/deadline_dropped": missed, "faults/deadline_stragglers": cut})
        return metrics

    def _check_loss_growth(self, round_idx: int, losses: list[float]) -> None:
        """A finite loss that grows by orders of magnitude over the first round's is divergence too:
        a warning (once), or a DivergenceError beyond ``faults.max_loss_growth``."""
        finite = [loss for loss in losses if math.isfinite(loss)]
        if not finite:
            return
        loss = sum(finite) / len(finite)
        if self._first_loss is None:
            self._first_loss = loss
            return
        growth = loss / self._first_loss if self._first_loss > 0 else 0.0
        limit = getattr(self.faults, "max_loss_growth", None)
        if limit is not None and growth > limit:
            raise self._diverged(
                f"round {round_idx}: the mean training loss {loss:.4g} is {growth:.3g}x the first round's ({self._first_loss:.4g}), "
                f"more than faults.max_loss_growth = {limit:g}"
            )
        if growth > LOSS_GROWTH_WARNING and not self._growth_reported:
            self._growth_reported = True
            log.warning(
                "round %d: the mean training loss %.4g is %.3gx the first round's (%.4g): the run is diverging; "
                "lower local.lr or the algorithm's global_lr (faults.max_loss_growth stops such a run)",
                round_idx, loss, growth, self._first_loss,
            )  # fmt: skip

    def _aggregate(self, plan, x, results, server_state, info, local_steps) -> tuple[TensorDict, NestedState]:
        """The pseudo-gradient and new server state from every client's upload."""
        uploads = results.uploads
        if not all_finite(uploads):
            for client, upload in zip(results.client_ids, uploads):
                bad = first_non_finite(upload)
                if bad is not None:
                    raise self._diverged(f"round {plan.round}: client {client} sent a non-finite update ({bad})")
        if self.robust is not None:  # the rule's r stands for every upload (fl_lightning/robust/aggregation.py)
            return self._aggregate_robust(plan, x, results, server_state, info, local_steps)
        if self.messages.aggregate is not None:  # an aggregate stage: fixed weights and its extra upload in the sum
            sums = self.algorithm.upload_sum(x, uploads, self.messages.aggregation_weights(info)(uploads), info)
            return self.algorithm.aggregate_sum(x, self._with_extra(x, sums, info), server_state, info, local_steps)
        weights = survivor_weights(plan.clients, plan.weights, results.client_ids)
        return self.algorithm.aggregate(x, uploads, weights, server_state, info, local_steps)

    def _aggregate_robust(self, plan, x, results, server_state, info, local_steps) -> tuple[TensorDict, NestedState]:
        """Clip and compress (client stages, already applied) -> the robust rule -> the aggregate stage's noise."""
        uploads, ids = results.uploads, results.client_ids
        if self.messages.aggregate is not None:
            weights = self.messages.aggregation_weights(info)(uploads)
        else:
            weights = survivor_weights(plan.clients, plan.weights, ids)
        reference = self._root_update(x, server_state, info) if self.robust.needs_reference else None
        self._robust_round = self.robust.combine(uploads, weights, ids, reference)
        sums = self.algorithm.upload_sum(x, [self._robust_round.upload] * len(uploads), weights, info)
        if self.messages.aggregate is not None:
            sums = self._with_extra(x, sums, info)
        return self.algorithm.aggregate_sum(x, sums, server_state, info, local_steps)

    def _root_update(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> Payload:
        """FLTrust's g0: the algorithm's client rule run by the server on its root dataset (a fresh client's state,
        the round's broadcast, K local steps, minibatches from (seed, round)); nothing of it is stored."""
        from fl_lightning.executors.sequential import run_task
        from fl_lightning.robust.root_data import ROOT_STREAM, RootData

        data = self.datamodule
        if self._root_data is None or self._root_data[0] is not data:
            self._root_data = (data, RootData(data, self.robust.root_size))
        root = self._root_data[1]
        broadcast = self.algorithm.broadcast(x, server_state, info)
        steps = root.num_local_steps(0, self.local.batch_size, self.local.steps, self.local.epochs)
        initial = ClientState(self.algorithm.client_state_init(x), {})
        task = ClientTask(0, derive_seed(data.seed, info.round, ROOT_STREAM), steps, broadcast, lambda: initial)
        with torch.inference_mode(False), torch.enable_grad():
            result = run_task(task, info, dataclasses.replace(self._runtime(private=False), data=root, fail_fast=True))
        return result.upload

    def _run_dir(self) -> str | None:
        """Where files of the run go beside its metrics: the first logger's directory, else the trainer's root."""
        return next((lg.log_dir for lg in self.trainer.loggers if getattr(lg, "log_dir", None)), self.trainer.default_root_dir)

    def _cohort(self) -> int | None:
        """The clients a round selects, where the participation fixes their number (else None: checked per round)."""
        participation = getattr(self.datamodule, "participation", None)
        count = getattr(participation, "count", None)
        return int(count(self.datamodule.num_clients)) if callable(count) else None

    def _aggregate_summed(self, plan, x, summed: SummedRound, server_state, info, local_steps) -> tuple[TensorDict, NestedState]:
        """The pseudo-gradient and new server state from the uploads' sums (``SummedRound``)."""
        if summed.non_finite:
            raise self._diverged(f"round {plan.round}: client {summed.non_finite[0]} sent a non-finite update")
        sums = self._with_extra(x, summed.sums, info) if self.messages.aggregate is not None else summed.sums
        return self.algorithm.aggregate_sum(x, sums, server_state, info, local_steps)

    def _with_extra(self, x: TensorDict, sums, info: RoundInfo):
        """The uploads' sums plus the aggregate stage's extra upload (e.g. privacy's noise), drawn once
        on the server from (seed, round): the same for every executor and on every process."""
        extra = self.messages.extra_sum(self.algorithm, x, upload_like(self.algorithm, x), info, self.datamodule.seed)
        return add_sums(sums, extra)

    def _diverged(self, message: str) -> DivergenceError:
        """The divergence error, naming the newest checkpoint (written from a finite state) to go back to."""
        paths = []
        for callback in getattr(self._trainer, "checkpoint_callbacks", None) or []:
            paths += [p for p in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")) if p]
        paths = [p for p in paths if os.path.exists(p)]
        last = f"the last good checkpoint is {max(paths, key=os.path.getmtime)}" if paths else "no checkpoint was written"
        return DivergenceError(f"{message}; {last}; lower local.lr or the algorithm's global_lr")

    def _runtime(self, aggregation_weights=None, private: bool = True) -> ClientRuntime:
        """What client training may use; ``private=False``: without record-level DP-SGD (evaluation's
        personalization trains on the client's own device and sends nothing)."""
        data = self.attack.data_view(self.datamodule) if self.attack is not None else self.datamodule
        return ClientRuntime(
            self.algorithm, self.objective, data, self.local, self.device, self.faults.fail_fast,
            tuple(self.personal_names), self._stop_requested, aggregation_weights, self.record_privacy if private else None,
        )  # fmt: skip

    def _stop_requested(self) -> bool:
        """Whether Lightning received SIGTERM (its own loops would only act after the round)."""
        return self._trainer is not None and self._trainer.received_sigterm

    def _tasks(
        self, clients: list[int], seeds: list[int], broadcast: Payload, round_idx: int, warmup: bool = False, allowed=None
    ) -> tuple[RoundTasks, int]:
        """The client tasks as columns (each client's K computed here, and only here) and the number of stragglers.

        In a round, ``self.faults`` drops clients and cuts stragglers' budgets, drawn from their round seeds;
        ``allowed`` (the clock's deadline, ``fl_lightning.clock.rounds``) caps each client's steps (0: dropped).
        """
        data, local = self.datamodule, self.local
        kept = TaskColumns([], [], [])
        stragglers = 0
        init = functools.partial(self.algorithm.client_state_init, broadcast["x"])
        states = RoundStates(self.store, init, self._initial_personal, self.device, is_message_state)
        faults = self.faults.active and not warmup  # the same for every client: read once, not per client
        full = _local_steps(data, clients, local)
        drawn = self.faults.draws(seeds, full) if faults else None  # every client's draw at once
        if drawn is None and allowed is None:
            kept = TaskColumns(list(clients), list(seeds), list(full))
        else:
            for i, (cid, seed) in enumerate(zip(clients, seeds)):
                steps = budget = full[i]
                if drawn is not None:
                    dropped, budget = drawn[i]
                    if dropped:
                        log.warning("round %d: client %d dropped out (never reported)", round_idx, cid)
                        continue
                    stragglers += budget < steps
                if allowed is not None and allowed[cid] < budget:
                    if not allowed[cid]:
                        log.info("round %d: client %d misses the deadline (never reports)", round_idx, cid)
                        continue
                    budget = allowed[cid]
                for column, value in zip(kept, (cid, seed, budget)):
                    column.append(value)
        own = {}
        if self.lora is not None:  # a client of a lower rank gets the broadcast zero-padded to its rank
            own = {i: self.lora.client_broadcast(broadcast, cid) for i, cid in enumerate(kept.client_ids) if self.lora.client_rank(cid) < self.lora.rank}
        load_state = functools.partial(self.client_state, x=broadcast["x"])
        load_messages = self.message_state if self.messages.client_stages else None
        return RoundTasks(kept, broadcast, load_state, warmup, load_messages, states, own), stragglers

    def _empty_round(self, plan: RoundPlan, broadcast: Payload, extra_metrics: dict[str, int]) -> None:
        """No client reported (possible under Bernoulli activation): x, the server state and the
        client store stay as they are, and the round is logged with ``train/clients = 0``.

        The server optimizer still steps, with every ``.grad`` set to None, so that Lightning
        counts the round (in manual optimization ``global_step`` counts optimizer steps).
        torch.optim optimizers skip parameters whose grad is None: neither x nor the
        optimizer's moments or step counts change.
        """
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        if self.messages:
            extra_metrics = {**extra_metrics, **self.messages.end_round(RoundInfo(plan.round, 0.0, self.datamodule.num_clients, plan), 0)}
        self._log_round(plan, broadcast, [], [], extra_metrics)

    def _warmup(self, x: TensorDict, server_state: NestedState, info: RoundInfo) -> NestedState:
        """The algorithm's pass over all N clients before round 0 (e.g. Scaffold-P's c_i^0, c^0),
        run by the executor like any round's tasks."""
        broadcast, clients = self.algorithm.broadcast(x, server_state, info), list(range(info.num_clients))
        seeds = derive_seeds(self.datamodule.seed, clients, WARMUP_STREAM).tolist()  # derive_seed(seed, cid, WARMUP_STREAM)
        tasks, _ = self._tasks(clients, seeds, broadcast, info.round, warmup=True)
        results = self.executor.run(tasks, info, self._runtime())
        uploads = [r.upload for r in results]
        server_state = self.algorithm.server_warmup(x, uploads, server_state, info)
        store_results(self.store, results)
        count_messages(self.comm_totals, broadcast, uploads)
        return server_state

    def _log_round(
        self, plan: RoundPlan, broadcast: Payload, uploads, results, extra_metrics: dict[str, int], summed: SummedRound | None = None,
        broadcast_bytes: int | None = None,
    ) -> None:
        results = RoundResults.of(results)
        losses, accuracies = results.mean_losses, results.accuracies
        from_sums = {}
        if summed is not None:  # the same numbers from the uploads' sizes and sums (to float tolerance)
            consistency = consistency_from_sums(summed.delta_sum, summed.delta_sq_sum, len(summed.results))
            from_sums = {"upload_bytes": summed.upload_bytes, "consistency": consistency}
        elif results:  # message stages' encoded sizes, or the bytes of each upload's tensors
            from_sums = {"upload_bytes": results.upload_bytes}
        if broadcast_bytes is not None:
            from_sums["broadcast_bytes"] = broadcast_bytes
        metrics = round_metrics(
            plan.round, self.local.lr_at(plan.round), losses, uploads, broadcast, self.comm_totals, accuracies, **from_sums
        )
        metrics.update(loss_term_means(results.loss_terms))
        metrics.update({k: float(v) for k, v in extra_metrics.items()})
        metrics["time/round_s"] = time.perf_counter() - self._round_started
        compile_s = getattr(self.executor.inner, "compile_seconds", None)  # compiled execution: seconds compiling so far
        if compile_s is not None:
            metrics["time/compile_s"] = compile_s
        # Straight to the loggers (`self.log` costs milliseconds per key, a real share of a
        # small round), at the step Lightning gives this round's evaluation: the round index.
        for logger in self.loggers:
            logger.log_metrics(metrics, step=plan.round)
        if self.global_rank == 0:
            csv_resume.flush(self.loggers)  # metrics.csv holds every finished round (appends the new row)
        values = {k: torch.scalar_tensor(v) for k, v in metrics.items()}  # torch.tensor(v) of a float, at half its cost
        self.trainer.callback_metrics.update(values)  # visible to callbacks (early stopping, targets)
        self.trainer.logged_metrics.update(values)
        self.trainer.progress_bar_metrics["train/loss"] = metrics["train/loss"]

    # ---- evaluation of the global model ---------------------------------------------------------
    def _evaluate(self, batch: Any, loss_metric: MeanMetric, acc_metric: MeanMetric, prefix: str) -> None:
        if self.attack is not None and (prefix == "test" or not getattr(self.datamodule, "val_fraction", 0)):  # test inputs only
            self._backdoor_success(batch, getattr(self, f"{prefix}_asr", None))
        loss, logits, target = self.objective(batch)
        if self.objective.token_level:  # a language model: loss and accuracy over the scored tokens
            scored = target != -100
            loss_metric.update(loss, weight=scored.sum())
            acc_metric.update((logits.argmax(-1) == target)[scored].float())
        else:
            loss_metric.update(loss, weight=len(target))
            acc_metric.update((logits.argmax(-1) == target).float())
        kw = dict(on_step=False, on_epoch=True, add_dataloader_idx=False)
        self.log(f"{prefix}/loss", loss_metric, prog_bar=prefix == "val", **kw)
        self.log(f"{prefix}/acc", acc_metric, prog_bar=True, **kw)

    def _backdoor_success(self, batch: Any, metric: MeanMetric | None) -> None:
        """``attack/backdoor_asr``: the share of triggered test inputs of non-target classes predicted as the target."""
        if metric is None or self.attack.backdoor is None:
            return
        inputs, targets = self.attack.backdoor.triggered(*split_batch(batch))
        if len(targets):
            _, logits, target = self.objective((inputs, targets))
            metric.update((logits.argmax(-1) == target).float())
        self.log("attack/backdoor_asr", metric, on_step=False, on_epoch=True, add_dataloader_idx=False)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Loader 0 is the validation set; loader 1, when the data has a validation split, the test set."""
        if dataloader_idx == 0:
            self._evaluate(batch, self.val_loss, self.val_acc, "val")
        else:
            self._evaluate(batch, self.test_loss, self.test_acc, "test")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, self.test_loss, self.test_acc, "test")

    def on_validation_epoch_end(self) -> None:
        if self.global_step > 0:  # the 0-based round the evaluation follows, on the evaluation's row too
            self.log("round", float(self.global_step - 1), on_step=False, on_epoch=True)

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()  # a test of the final (or a checkpoint's) model names its round too

    # ---- checkpoints: everything a resume needs ------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What a resume must match (``fl_lightning/reliability/fingerprint.py``)."""
        if self._schema is None:
            self._schema = fingerprint.schema(self.algorithm, self.model, self.global_params())
            if self.lora is not None and self.lora.describe() is not None:
                self._schema["lora_aggregation"] = self.lora.describe()
            for setting in ("attack", "robust"):
                if getattr(self, setting) is not None:
                    self._schema[setting] = fingerprint.describe_setting(getattr(self, setting))
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if data is None or not hasattr(data, "client_sizes"):
            return dict(self._schema)
        if self._partition is None or self._partition[0] is not data:
            self._partition = (data, fingerprint.partition_digest(data))
        return {**self._schema, "num_clients": int(data.num_clients), "partition": self._partition[1]}

    def _check_fingerprint(self, saved: dict[str, Any] | None, federated: dict[str, Any]) -> None:
        """Stop a resume whose checkpoint was written by a different run setup, naming what differs."""
        diffs = fingerprint.differences(saved, self.fingerprint(), federated.get("server_state", {}), type(self.algorithm).__name__)
        if diffs:
            path = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
            raise CheckpointError(
                f"checkpoint {path or ''} does not match this run: {'; '.join(diffs)}; "
                "resume with the settings it was written with, or start a new run without --ckpt_path"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == 0:
            csv_resume.flush(self.loggers)  # the rows of every round this checkpoint holds, on disk before it
        state = {"x": self.global_params(), **{f"server/{n}": td for n, td in (self.server_state or {}).items()}}
        if not all_finite([state]):
            raise DivergenceError(f"no checkpoint is written from a non-finite state ({first_non_finite(state)})")
        checkpoint[_CKPT_KEY] = {
            "client_store": self.store.checkpoint_state(self.global_step),
            "server_state": flatten_state(self.server_state or {}),
            "comm_totals": dict(self.comm_totals),
            "fingerprint": self.fingerprint(),
            "first_loss": self._first_loss,
        }
        if self.clock is not None:  # only then, as below
            checkpoint[_CKPT_KEY]["clock"] = {"sim_time": self.sim_time}
            if self.asynchronous is not None:
                checkpoint[_CKPT_KEY]["clock"]["events"] = self._events.state_dict()
        if self.messages:  # only then: a run without message stages writes the checkpoint it always wrote
            checkpoint[_CKPT_KEY]["messages"] = self.messages.state_dict()
        if self.record_privacy is not None:
            checkpoint[_CKPT_KEY]["record_privacy"] = self.record_privacy.state_dict()
        if self.robust is not None:  # only then: a run without it writes the checkpoint it always wrote
            checkpoint[_CKPT_KEY]["robust"] = self.robust.state_dict()
        wandb_ids = [str(logger.version) for logger in self.loggers if type(logger).__name__ == "WandbLogger" and logger.version]
        if wandb_ids:  # a resume continues this wandb run (fl_lightning/run/cli_app.py)
            checkpoint["loggers"] = {"wandb_run_id": wandb_ids[0]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(_CKPT_KEY)
        if state is None:
            return
        self._check_fingerprint(state.get("fingerprint"), state)
        self._resumed_step = int(checkpoint.get("global_step", 0))
        self.store.load_checkpoint_state(state["client_store"])
        self.server_state = unflatten_state(state["server_state"])
        self.comm_totals = dict(state["comm_totals"])
        if self.messages:
            self.messages.load_state_dict(state.get("messages", {}))
        if self.record_privacy is not None and "record_privacy" in state:
            self.record_privacy.load_state_dict(state["record_privacy"])
        if self.robust is not None:
            self.robust.load_state_dict(state.get("robust", {}))
        self._first_loss = state.get("first_loss")
        saved_async = "events" in state.get("clock", {})
        if saved_async != (self.asynchronous is not None) and int(checkpoint.get("global_step", 0)) > 0:
            raise CheckpointError(
                f"checkpoint {getattr(self._trainer, 'ckpt_path', None) or ''} was written {'with' if saved_async else 'without'} "
                f"model.asynchronous and this run is {'without' if saved_async else 'with'} it; resume with the settings it was written with"
            )
        if self.clock is not None and "clock" in state:
            self.sim_time = float(state["clock"]["sim_time"])
            if self.asynchronous is not None:
                self._events = self.asynchronous.events_from(state["clock"]["events"])
        if state.get("personal_store"):  # checkpoints before personal tensors became client state
            legacy = ClientStore()
            legacy.load_state_dict(state["personal_store"])
            for cid in legacy.client_ids():
                self.store.put(cid, {**self.store.get(cid, dict), PERSONAL: legacy.get(cid, dict)["v"]})
