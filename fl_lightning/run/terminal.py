"""What ``fl-lightning fit`` prints: a progress bar counted in rounds, one result line at the end,
and none of Lightning's start-up boilerplate.

``RoundProgressBar`` replaces Lightning's epoch/batch bar (which reads ``Epoch 0/-2 … 20/20``
for a round loop) with ``round 20/100 · 2.1 rounds/s · train loss 0.512 · val acc 0.873 · eps 3.21``.
``RunSummary`` records the evaluations of a fit and renders the closing line
``FedAvg: 100 rounds in 52.1 s · final val acc 0.9123 · best 0.9230 (round 90) · 12.3 MB sent
· epsilon 3.21 (RDP, delta 1e-05)``, then each mechanism of the round with all its settings (``attack
Attack(..., data=LabelFlip(...), upload=SignFlip(...))``, ``robust Robust(rule='median', ...)``): a partial
override of a class setting shows what it merged with. An asynchronous run counts ``server updates`` under
``FedBuff (FedAvg)``; a run under the clock adds its simulated seconds. Under differential privacy (docs/privacy.md) both show the
privacy spent: ``privacy/epsilon`` (``eps``) and ``privacy/record_epsilon`` (``record eps``). For a
token-level model (a causal LM) the line reports the held-out loss, perplexity and ROUGE-L instead of a
next-token accuracy: ``LocalAdam: 50 rounds in 812.0 s · final eval loss 1.8312 · ppl 6.24 · ROUGE-L 0.3120
(32 samples) · best eval loss 1.8312 (round 50) · 45.1 MB sent · adapter runs/fedit_dolly/version_0/adapter``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

ACC, LOSS, BYTES = "val/acc", "train/loss", "comm/cumulative_bytes"
PRIVACY = (("privacy/epsilon", "eps", "epsilon", "privacy"), ("privacy/record_epsilon", "record eps", "record epsilon", "record_privacy"))
"""(metric, progress bar label, result line label, the module's settings attribute) of each guarantee."""

#: Lightning loggers whose INFO lines are boilerplate for a round loop ("GPU available: False",
#: "TPU available", "💡 Tip: ...", "`Trainer.fit` stopped: `max_steps=…` reached", "Seed set to 0").
QUIET_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
    "lightning.pytorch.accelerators.cuda",
)


def quiet_lightning() -> None:
    """Silence Lightning's start-up INFO lines and warnings that do not apply to the CLI.

    Warnings (``rank_zero_warn``) still show; ``FL_LIGHTNING_VERBOSE=1`` keeps everything.
    """
    if os.environ.get("FL_LIGHTNING_VERBOSE"):
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # fl-lightning passes parsed arguments to LightningCLI itself (it handles `compare` and the
    # checkpoint defaults first), which Lightning would flag on every command.
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended to run from within Python.*")


def run_terms(pl_module: Any) -> tuple[str, str]:
    """(the run's name, what one training step is) in the run's own terms: ``("FedBuff (FedAvg)", "server updates")``
    under asynchronous aggregation, ``("FedAvg", "rounds")`` otherwise."""
    name = type(getattr(pl_module, "algorithm", pl_module)).__name__
    asynchronous = getattr(pl_module, "asynchronous", None)
    if asynchronous is None:
        return name, "rounds"
    return f"{'FedAsync' if asynchronous.mode == 'fedasync' else 'FedBuff'} ({name})", "server updates"


def mechanisms(pl_module: Any) -> list[str]:
    """``setting: description`` of every mechanism of the run's round (attack, defence, compression, DP, clock,
    faults, LoRA aggregation, a user's stage), each with all its settings, so a partial override is visible."""
    named = []
    for stage in getattr(getattr(pl_module, "rounds", None), "stages", ()):
        described = stage.describe()
        if described:
            named.append(f"{(stage.setting or stage.name).removeprefix('model.')} {described}")
    asynchronous = getattr(pl_module, "asynchronous", None)
    if asynchronous is not None:
        from fl_lightning.reliability.fingerprint import describe_setting

        named.append(f"clock {describe_setting(pl_module.clock)}")
    return named


def _epsilon(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _value(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


PERSONAL_METRICS = ("personal_acc_mean", "personal_acc_worst10", "unseen_acc_mean")
"""The personalized metrics the result line reports (docs/personalization.md, "Evaluation protocol")."""


class RunSummary(Callback):
    """Records a fit's evaluations and wall time; ``line()`` is the one-line result of the run."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds = 0.0
        self.rounds = 0
        self.accuracies: list[tuple[int, float]] = []  # (round, val/acc)
        self.bytes_total: float | None = None
        self.compile_s: float | None = None  # compiled execution: seconds compiling (time/compile_s)
        self.stacking: str | None = None  # batched execution: rounds stacked and padding (BatchedExecutor.stats)
        self.name = ""
        self.start_round = 0
        self.test_acc: float | None = None  # the final model on the test set, once (with a validation split)
        self.threads: int | None = None  # torch intra-op threads of the run (--threads), in the line's header
        self.personal: dict[str, float] = {}  # the last evaluation's personalized metrics (PersonalizedEvaluation)
        self.privacy: list[str] = []  # "epsilon 3.21 (RDP, delta 1e-05)" of each guarantee the run has
        self.token_level = False  # a language model: losses, perplexity and ROUGE-L instead of accuracies
        self.losses: list[tuple[int, float]] = []  # (round, eval/loss, else val/loss) of a token-level model
        self.loss_name = "eval"
        self.language: dict[str, float] = {}  # the last evaluation's eval/ppl, eval/rougeL, eval/gen_samples
        self.test_loss: float | None = None  # token-level: the final model's test/loss (without eval/* of its own)
        self.exported: str | None = None  # where ExportPretrained wrote the final model
        self.unit = "rounds"  # what one training step is: "server updates" under asynchronous aggregation
        self.sim_s: float | None = None  # simulated seconds at the end (with a clock)
        self.mechanisms: list[str] = []  # the round's mechanisms with their settings (``mechanisms``)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = time.perf_counter()
        self.name, self.unit = run_terms(pl_module)
        self.mechanisms = mechanisms(pl_module)
        self.token_level = bool(getattr(getattr(pl_module, "model", None), "token_level", False))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_round = trainer.global_step  # > 0 after a resume (the checkpoint is restored by now)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.token_level and not trainer.sanity_checking:
            self._record_language(trainer)
        acc = _value(trainer.callback_metrics, ACC)
        if acc is not None and not trainer.sanity_checking:
            self.accuracies.append((trainer.global_step, acc))
        for name in PERSONAL_METRICS:
            value = _value(trainer.callback_metrics, f"val/{name}")
            if value is not None and not trainer.sanity_checking:
                self.personal[name] = value

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.token_level and self.start is not None:  # the test after fit: the final model's eval/*, if evaluated anew
            self._record_language(trainer)

    def _record_language(self, trainer: Trainer) -> None:
        """A token-level model's evaluation: ``eval/loss`` (InstructionEvaluation), else the response-token ``val/loss``."""
        metrics = trainer.callback_metrics
        loss = _value(metrics, "eval/loss")
        self.loss_name = "eval" if loss is not None else "val"
        if loss is None:
            loss = _value(metrics, "val/loss")
        if loss is None:
            return
        if self.losses and self.losses[-1][0] == trainer.global_step:
            self.losses[-1] = (trainer.global_step, loss)
        else:
            self.losses.append((trainer.global_step, loss))
        for key in ("eval/ppl", "eval/rougeL", "eval/gen_samples"):
            value = _value(metrics, key)
            if value is not None:
                self.language[key] = value

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.seconds = time.perf_counter() - (self.start or time.perf_counter())
        self.rounds = trainer.global_step
        self.bytes_total = _value(trainer.callback_metrics, BYTES)
        self.sim_s = _value(trainer.callback_metrics, "time/sim_s") if getattr(pl_module, "clock", None) is not None else None
        self.compile_s = _value(trainer.callback_metrics, "time/compile_s")
        self.stacking = stacking_summary(getattr(getattr(pl_module, "executor", None), "stats", None))
        executor = getattr(pl_module, "training_executor", None)
        described = executor.describe() if executor is not None else None
        if described and described not in self.mechanisms:  # e.g. the execution ``auto`` chose
            self.mechanisms = [*self.mechanisms, described]
        self.privacy = []
        for key, _, label, attribute in PRIVACY:
            value, settings = _value(trainer.callback_metrics, key), getattr(pl_module, attribute, None)
            if settings is None and attribute == "privacy":  # distributed DP under secure aggregation logs the same key
                settings = getattr(pl_module, "secure_aggregation", None)
            if value is not None and settings is not None:
                self.privacy.append(f"{label} {_epsilon(value)} ({settings.method.upper()}, delta {settings.delta:g})")

    @property
    def final_acc(self) -> float | None:
        return self.accuracies[-1][1] if self.accuracies else None

    @property
    def best(self) -> tuple[int, float] | None:
        return max(self.accuracies, key=lambda ra: ra[1]) if self.accuracies else None

    def line(self) -> str:
        step = "server update" if self.unit == "server updates" else "round"
        resumed = f" (resumed at {step} {self.start_round})" if self.start_round else ""
        simulated = f" ({self.sim_s:.1f} s simulated)" if self.sim_s is not None else ""
        threads = "" if self.threads is None else f" on {self.threads} thread{'s' if self.threads != 1 else ''}"
        compiled = f" ({self.compile_s:.1f} s compiling)" if self.compile_s is not None else ""
        stacking = f" ({self.stacking})" if self.stacking else ""
        parts = [f"{self.name}: {self.rounds} {self.unit}{resumed} in {self.seconds:.1f} s{simulated}{threads}{compiled}{stacking}"]
        if self.token_level:
            parts += self._language_parts()
        elif self.final_acc is not None:
            best_round, best_acc = self.best
            parts.append(f"final val acc {self.final_acc:.4f}")
            parts.append(f"best {best_acc:.4f} ({step} {best_round})")
        else:
            parts.append("no evaluation (set trainer.val_check_interval)")
        if self.test_acc is not None and not self.token_level:
            parts.append(f"test acc {self.test_acc:.4f} (final model)")
        if "personal_acc_mean" in self.personal:
            parts.append(
                f"per-client acc {self.personal['personal_acc_mean']:.4f} (the model each client predicts with, on the validation "
                f"half of its held-out data, mean; worst 10% {self.personal['personal_acc_worst10']:.4f}; per client at every "
                "evaluation: clients.csv)"
            )
        if "unseen_acc_mean" in self.personal:
            parts.append(f"unseen clients {self.personal['unseen_acc_mean']:.4f}")
        if self.bytes_total is not None:
            parts.append(f"{self.bytes_total / 1e6:.1f} MB sent")
        if self.exported is not None and self.token_level:
            parts.append(f"adapter {self.exported}")
        return " · ".join(parts + self.privacy + self.mechanisms)

    def _language_parts(self) -> list[str]:
        """Final loss, perplexity and ROUGE-L (where computed) and the best loss of a token-level model."""
        if not self.losses:
            if self.test_loss is not None:
                return [f"test loss {self.test_loss:.4f} · ppl {math.exp(min(self.test_loss, 50.0)):.2f} (final model)"]
            return ["no evaluation (set trainer.val_check_interval)"]
        final = self.losses[-1][1]
        ppl = self.language.get("eval/ppl", math.exp(min(final, 50.0)))
        parts = [f"final {self.loss_name} loss {final:.4f}", f"ppl {ppl:.2f}"]
        if "eval/rougeL" in self.language:
            samples = int(self.language.get("eval/gen_samples", 0))
            parts.append(f"ROUGE-L {self.language['eval/rougeL']:.4f} ({samples} samples)")
        best_round, best = min(self.losses, key=lambda rl: rl[1])
        parts.append(f"best {self.loss_name} loss {best:.4f} (round {best_round})")
        if self.test_loss is not None and self.loss_name == "val":
            parts.append(f"test loss {self.test_loss:.4f} · ppl {math.exp(min(self.test_loss, 50.0)):.2f} (final model)")
        return parts


class RoundProgressBar(ProgressBar):
    """One bar for the whole fit, counted in rounds, with the train loss and the last val acc.

    Evaluations update the bar's ``val acc`` field instead of drawing bars of their own.
    Written to stderr with tqdm (a Lightning dependency); on a non-terminal it refreshes at
    most every ``min_interval`` seconds.
    """

    def __init__(self, min_interval: float = 0.5) -> None:
        super().__init__()
        self._enabled = True
        self._bar = None
        self._eval_bar = None
        self.min_interval = min_interval

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def _eval_start(self, trainer: Trainer, desc: str, total: float) -> None:
        """``fl-lightning validate|test``: a bar over the evaluation batches (inside ``fit``,
        evaluations only update the round bar's ``val acc``)."""
        if not self._enabled or not trainer.is_global_zero or self._bar is not None:
            return
        from tqdm.auto import tqdm

        self._eval_bar = tqdm(total=None if math.isinf(total) else int(total), desc=desc, unit="batch",
                              dynamic_ncols=True, file=sys.stderr, mininterval=self.min_interval)  # fmt: skip

    def _eval_step(self) -> None:
        if getattr(self, "_eval_bar", None) is not None:
            self._eval_bar.update(1)

    def _eval_end(self) -> None:
        if getattr(self, "_eval_bar", None) is not None:
            self._eval_bar.close()
            self._eval_bar = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._eval_start(trainer, "validate", self.total_val_batches)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_step()

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start(trainer, "test", sum(trainer.num_test_batches))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_step()

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._enabled or not trainer.is_global_zero:
            return
        from tqdm.auto import tqdm

        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        unit = "update" if run_terms(pl_module)[1] == "server updates" else "round"
        self._bar = tqdm(
            total=total,
            initial=trainer.global_step,
            desc="server update" if unit == "update" else "round",
            unit=unit,
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=self.min_interval,
            bar_format="{desc} {n_fmt}/{total_fmt} |{bar:20}| {elapsed}<{remaining} · {rate_fmt}{postfix}",
        )

    def _postfix(self, trainer: Trainer) -> str:
        parts = []
        loss = _value(trainer.callback_metrics, LOSS)
        if loss is not None:
            parts.append(f"train loss {loss:.3f}")
        eval_loss = _value(trainer.callback_metrics, "eval/loss")
        acc = _value(trainer.callback_metrics, ACC)
        if eval_loss is not None:  # a language model's held-out loss and perplexity (InstructionEvaluation)
            parts.append(f"eval loss {eval_loss:.3f} · ppl {math.exp(min(eval_loss, 50.0)):.1f}")
        elif acc is not None:
            parts.append(f"val acc {acc:.4f}")
        for key, label, _, _ in PRIVACY:
            epsilon = _value(trainer.callback_metrics, key)
            if epsilon is not None:
                parts.append(f"{label} {_epsilon(epsilon)}")
        return " · ".join(parts)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(trainer), refresh=False)
            self._bar.update(trainer.global_step - self._bar.n)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end()
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(trainer))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._eval_end()
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(self.trainer))
            self._bar.close()
            self._bar = None

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        message = sep.join(map(str, args))
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, **kwargs)


def stacking_summary(stats: dict | None) -> str | None:
    """Batched execution's stacking counters in words (``BatchedExecutor.stats``): the share of rounds run stacked
    and the share of their work that was padding (docs/performance.md, "Masked stacking"); None without them."""
    if not stats or not stats.get("rounds"):
        return None
    work = stats["real_work"] + stats["padded_work"]
    waste = stats["padded_work"] / work if work else 0.0
    fused = f", {stats['compiled_rounds']} as one compiled program" if "compiled_rounds" in stats else ""
    return f"{stats['stacked_rounds']} of {stats['rounds']} rounds stacked{fused}, {100 * waste:.0f}% of their work padding"
