"""FederatedModule: one Lightning training step = one federated round (docs/architecture.md)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from fl_lightning.adversary import Attack
from fl_lightning.algorithms import Algorithm, FedAvg, RoundInfo
from fl_lightning.clock import SimClock
from fl_lightning.clock.asynchronous import AsyncAggregation
from fl_lightning.compression.stages import Compression
from fl_lightning.core import params as P
from fl_lightning.core.client_data import ClientData
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.local_loss import check_label_counts, check_local_loss
from fl_lightning.core.objective import Objective
from fl_lightning.core.params import TensorDict
from fl_lightning.core.participation import RoundPlan
from fl_lightning.core.state import ClientStore, NestedState
from fl_lightning.engine import fit_checks
from fl_lightning.engine.checkpointing import Checkpointing
from fl_lightning.engine.client_states import ClientStates
from fl_lightning.engine.compiled_round import CompiledRoundHost
from fl_lightning.engine.evaluation import GlobalEvaluation
from fl_lightning.engine.lifecycle import RunLifecycle, quiet_known_warnings
from fl_lightning.engine.prediction import PredictionParams
from fl_lightning.engine.round_log import publish, round_row
from fl_lightning.executors import ClientRuntime, Executor, resolve_executor
from fl_lightning.lora import LoRAAggregation
from fl_lightning.pipeline.correlated_noise import CorrelatedNoise
from fl_lightning.pipeline.messages import Stage
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.pipeline.record_privacy import RecordPrivacy
from fl_lightning.reliability import csv_resume
from fl_lightning.reliability.faults import ClientFaults, DivergenceError
from fl_lightning.robust.aggregation import Robust
from fl_lightning.rounds.build import RoundSettings, build_round
from fl_lightning.rounds.stage import Round, RoundStage, RunFacts
from fl_lightning.secagg import SecureAggregation

log = logging.getLogger(__name__)
DIVERGENCE_ADVICE = "lower local.lr or the algorithm's global_lr"


class FederatedModule(ClientStates, Checkpointing, GlobalEvaluation, PredictionParams, RunLifecycle, CompiledRoundHost, L.LightningModule):
    """Owns the global model, the server state, the client store and the round (docs/architecture.md).

    Each training step receives a ``RoundPlan`` from the datamodule and runs one round: the round's driver
    calls the stages built from the settings below (``fl_lightning.rounds``) around broadcast, local
    training by the executor and aggregation; the server optimizer applies the pseudo-gradient (so
    ``trainer.max_steps`` counts rounds and Lightning checkpoints the server optimizer's state).

    Args:
        model: the network; its trainable parameters not matched by ``personal`` are the federated tensors.
        algorithm: the federated algorithm (default FedAvg).
        local: local training settings.
        personal: glob patterns of parameter names, or module paths (``"head"``), kept per client and never sent,
            trained by algorithms with ``supports_personal``.
        execution: ``"sequential"``, ``"batched"`` (torch.func.vmap; sequential for declared reasons), or any
            ``fl_lightning.executors.Executor``. Under DDP it is wrapped to split the tasks over the processes.
        store: where per-client state lives: in memory (default) or a ``DiskClientStore``.
        faults: simulated client dropout, stragglers, failure limits and loss-growth divergence.
        uplink / downlink: message stages on the uploads / the broadcast (``fl_lightning.pipeline.messages``).
        privacy: client-level DP: ``ClientPrivacy`` (sampled) or ``CorrelatedNoise`` (DP-FTRL, banded MF), ``privacy/epsilon``.
        compression: compressors of the uploads and the broadcast with error feedback (docs/compression.md).
        record_privacy: record-level DP-SGD in local training (docs/privacy.md), ``privacy/record_epsilon``.
        clock: simulated time (docs/time.md): rounds wait for their slowest client or a deadline.
        asynchronous: FedBuff or FedAsync under the clock (docs/time.md): one step is one server update.
        robust: Byzantine-robust aggregation (docs/robustness.md); non-finite uploads are excluded as Byzantine.
        attack: malicious clients poisoning their data or uploads (docs/robustness.md, "Attacks").
        lora_aggregation: how the server aggregates LoRA adapters (docs/algorithms.md 28); None: the algorithm's own.
        secure_aggregation: SecAgg/SecAgg+ of the uploads, optionally distributed DP (docs/privacy.md); ``secagg/*`` metrics.
        stages: a user's own round stages (``fl_lightning.rounds.RoundStage``; docs/architecture.md, "Your own stage").
        gc_freeze: freeze Python's collector on the first round's objects (``fl_lightning.engine.collector``; off: docs/performance.md).
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
        privacy: ClientPrivacy | CorrelatedNoise | None = None,
        compression: Compression | None = None,
        record_privacy: RecordPrivacy | None = None,
        clock: SimClock | None = None,
        asynchronous: AsyncAggregation | None = None,
        robust: Robust | None = None,
        attack: Attack | None = None,
        lora_aggregation: str | LoRAAggregation | None = None,
        secure_aggregation: SecureAggregation | None = None,
        stages: list[RoundStage] | None = None,
        gc_freeze: bool = False,
    ) -> None:
        super().__init__()
        quiet_known_warnings()
        self.automatic_optimization = False
        self.model = model
        self.algorithm = algorithm if algorithm is not None else FedAvg()
        self.local = local if local is not None else LocalTraining()
        self.personal, self.gc_freeze = list(personal or []), gc_freeze
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
        fit_checks.check_personal(self.algorithm, model, self.personal, self.personal_names, self.local)
        self.store = store if store is not None else ClientStore()
        self.server_state: NestedState | None = None
        self.executor = resolve_executor(execution)
        self._training_executor = self.executor.inner  # the stages' client-side parts wrap around it
        self.faults, self.uplink, self.downlink, self.privacy, self.compression = faults, uplink or [], downlink or [], privacy, compression
        self.record_privacy, self.clock, self.asynchronous, self.robust, self.attack = record_privacy, clock, asynchronous, robust, attack
        self.lora_aggregation, self.secure_aggregation, self.stages = lora_aggregation, secure_aggregation, list(stages or [])
        self.objective = Objective(model, self.federated_names + self.personal_names)
        self._build_round()
        self._checked_data = self._schema = self._partition = self._resumed_step = None
        self.comm_totals = {"bytes_up": 0, "bytes_down": 0, "client_uploads": 0}
        self.val_loss, self.val_acc, self.test_loss, self.test_acc = MeanMetric(), MeanMetric(), MeanMetric(), MeanMetric()
        if attack is not None and attack.backdoor is not None:
            self.val_asr, self.test_asr = MeanMetric(), MeanMetric()

    # ---- the round, built from the settings ---------------------------------------------------------
    _ROUND_SETTINGS = ("faults", "uplink", "downlink", "privacy", "compression", "record_privacy", "clock", "asynchronous", "robust",
                       "attack", "lora_aggregation", "secure_aggregation", "stages")  # fmt: skip

    def _round_key(self) -> tuple:
        return tuple(id(getattr(self, name)) for name in self._ROUND_SETTINGS)

    def _build_round(self) -> None:
        """The round's stages and driver from the settings (again at ``setup`` when a setting was replaced);
        each stage's client-side part around the training executor, an earlier stage outside a later one."""
        settings = {name: getattr(self, name) for name in self._ROUND_SETTINGS}
        built = build_round(RoundSettings(self.model, self.algorithm, self.federated_names, self.personal_names, self.local, **settings))
        self.rounds, self.messages, self.lora, self._time = built.driver, built.messages, built.lora, built.time
        inner = self._training_executor
        for stage in reversed(self.rounds.stages):
            inner = stage.wrap_executor(inner)
        self.executor.inner, self._built_key = inner, self._round_key()

    @property
    def sim_time(self) -> float:
        """Simulated seconds since the run began (0 without a clock)."""
        return self._time.sim_time if self._time is not None else 0.0

    @property
    def _events(self):
        return getattr(self.rounds, "events", None)

    # ---- wiring -------------------------------------------------------------------------------------
    @property
    def datamodule(self) -> ClientData:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not self._checked_data:  # a structural check costs microseconds per member: once per datamodule
            if not isinstance(datamodule, ClientData):
                raise RuntimeError("FederatedModule needs a FederatedDataModule passed as `datamodule=` to the Trainer")
            self._checked_data = datamodule
        return datamodule

    def federated_parameters(self) -> list[nn.Parameter]:
        # Through the objective's resolved (module, attribute) slots: walking named_parameters() of a large
        # model (a peft-wrapped GPT-2) costs about a millisecond, several times a round.
        slots = self.objective.swap.slots
        return [module._parameters[attr] for module, attr in (slots[n] for n in self.federated_names)]

    def global_params(self) -> TensorDict:
        """The global federated tensors x (detached views of the live parameters)."""
        return {n: p.detach() for n, p in zip(self.federated_names, self.federated_parameters())}

    def setup(self, stage: str) -> None:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        from fl_lightning.reliability.checkpoint_io import StreamingCheckpointIO

        if self._round_key() != self._built_key:  # a setting replaced on the module after it was built
            self._build_round()
            self._schema = None
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and type(strategy.checkpoint_io) is TorchCheckpointIO:  # not a user's own
            strategy.checkpoint_io = StreamingCheckpointIO()  # streamed, beside the checkpoint
        check_data = getattr(self.model, "check_data", None)
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if callable(check_data) and data is not None:
            check_data(data)  # e.g. sequences longer than a language model's positions: one line, before anything runs
        bind_data = getattr(self.algorithm, "bind_data", None)
        if callable(bind_data) and data is not None:
            bind_data(data)  # before the server state, which may be sized by the data (AFL's lambda)
        if self.server_state is None:
            self.server_state = self.algorithm.server_state_init(P.detach_clone(self.global_params()))

    def on_fit_start(self) -> None:
        fit_checks.check_trainer(self.trainer)
        data, trainer = self.datamodule, self.trainer
        fit_checks.check_local_work(self.local, data)
        self.algorithm.check_local(self.local)
        self.rounds.check(data.num_clients)
        check_label_counts(self.algorithm, data)
        facts = RunFacts(self.algorithm, data, fit_checks.cohort_size(data), trainer.world_size, trainer.max_steps, self._run_dir(),
                         self._resumed_step or 0, self.global_rank, tuple(self.personal_names), tuple(s.name for s in self.rounds.stages),
                         self.local, self.runtime)  # fmt: skip
        for part in (*self.rounds.stages, self._training_executor):
            part.check(facts)
        if self.global_rank == 0:  # temporary files of killed checkpoint writes
            from fl_lightning.reliability.checkpoint_io import remove_stale_temporaries

            for path in remove_stale_temporaries(c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)):
                log.info("removed %s, left by a checkpoint write that did not finish", path)
        self.store.start()
        if callable(getattr(data, "place", None)):  # client data resident on the training device, copied there once
            data.place(self.device)
        fit_checks.check_rounds_left(self._resumed_step, trainer.max_steps, trainer.ckpt_path)
        if self._resumed_step is not None and self.global_rank == 0:
            csv_resume.continue_from(self.loggers, getattr(self, "_previous_metrics", None) or {}, self._resumed_step)
        elif self._resumed_step is None and self.global_rank == 0 and getattr(self, "_previous_metrics", None):
            csv_resume.replaced(self._previous_metrics)
        self._previous_metrics = {}
        if self.global_rank == 0:
            csv_resume.guard(self.loggers)  # a full or read-only metrics folder: one line naming it

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.algorithm.server_optimizer(self.federated_parameters())

    # ---- one round: the driver runs it; what it needs of the engine (``fl_lightning.rounds.RoundHost``) --------
    def training_step(self, plan: RoundPlan, batch_idx: int) -> None:
        self._round_started = time.perf_counter()
        self.rounds.run(self, plan)

    def round_info(self, round_idx: int, plan: RoundPlan | None, personal: bool = True) -> RoundInfo:
        """The facts of a round; ``personal``: with gamma_v (personal tensors, or a ``local.personal_lr`` a rule reads)."""
        with_personal = personal and (self.personal_names or self.local.personal_lr is not None)
        personal_lr = self.local.personal_lr_at(round_idx) if with_personal else None
        return RoundInfo(round_idx, self.local.lr_at(round_idx), self.datamodule.num_clients, plan, personal_lr)

    def apply_update(self, pseudo_grad: TensorDict | None) -> None:
        """The server optimizer's step on the pseudo-gradient. ``None`` (nothing aggregated): every ``.grad`` is
        None and torch.optim skips every parameter, so x and the optimizer's state stay as they are while
        Lightning still counts the round (in manual optimization ``global_step`` counts optimizer steps)."""
        optimizer = self.optimizers()
        if pseudo_grad is None:
            optimizer.zero_grad(set_to_none=True)
        else:  # no zero_grad: the pseudo-gradient replaces every parameter's .grad
            for name, param in zip(self.federated_names, self.federated_parameters()):
                param.grad = pseudo_grad[name].to(param.dtype)
        optimizer.step()

    def log_round(self, round: Round, uploads: Any, results: Any) -> None:
        compile_s = getattr(self.executor.inner, "compile_seconds", None)
        lr = self.local.lr_at(round.plan.round)
        metrics = round_row(round, lr, uploads, results, self.comm_totals, self._round_started, compile_s)
        publish(self.trainer, self.loggers, metrics, round.plan.round, self.global_rank)

    def runtime(self, aggregation_weights: Any = None, private: bool = True) -> ClientRuntime:
        """What client training may use; ``private=False``: without record-level DP-SGD (evaluation's
        personalization trains on the client's own device and sends nothing)."""
        runtime = ClientRuntime(self.algorithm, self.objective, self.datamodule, self.local, self.device, self.faults.fail_fast,
                                tuple(self.personal_names), self._stop_requested, aggregation_weights)  # fmt: skip
        for stage in self.rounds.stages:
            runtime = stage.local_training(runtime, private)
        return runtime

    def diverged(self, message: str, advice: str = DIVERGENCE_ADVICE) -> DivergenceError:
        """The divergence error, naming the newest checkpoint (written from a finite state) to go back to."""
        paths = []
        for callback in getattr(self._trainer, "checkpoint_callbacks", None) or []:
            paths += [p for p in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")) if p]
        paths = [p for p in paths if os.path.exists(p)]
        last = f"the last good checkpoint is {max(paths, key=os.path.getmtime)}" if paths else "no checkpoint was written"
        return DivergenceError(f"{message}; {last}; {advice}")

    def _run_dir(self) -> str | None:
        """Where files of the run go beside its metrics: the first logger's directory, else the trainer's root."""
        return next((lg.log_dir for lg in self.trainer.loggers if getattr(lg, "log_dir", None)), self.trainer.default_root_dir)

    def _stop_requested(self) -> bool:
        """Whether Lightning received SIGTERM (its own loops would only act after the round)."""
        return self._trainer is not None and self._trainer.received_sigterm
