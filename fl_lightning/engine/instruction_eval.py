"""Evaluation of federated instruction tuning: response loss and perplexity per category, and
a generation score (greedy decoding, ROUGE-L F1 against the reference response).

At every evaluation of ``fit`` (and at ``test``) the callback logs, for the global model:

- ``eval/loss`` and ``eval/ppl``: mean next-token cross-entropy over all response tokens of the
  held-out set, and its exponential (perplexity);
- ``eval/loss/<category>`` and ``eval/ppl/<category>``: the same over each category's examples;
- with ``data.holdout_fraction > 0``, per client on its own held-out examples: ``eval/clients/loss_mean``,
  ``eval/clients/ppl_mean`` and ``eval/clients/ppl_worst10`` (mean perplexity of the worst 10% of clients);
- ``eval/rougeL``: mean ROUGE-L F1 (``rouge-score``, stemming on) of greedy continuations of the first
  ``num_samples`` held-out prompts (a fixed sample, the same every evaluation), with
  ``eval/gen_samples`` and ``eval/max_new_tokens`` stating the settings;
- the generated examples as a table: ``generations_round_<r>.csv`` in the run's log folder and, when
  wandb logs, a ``wandb.Table`` ``eval/generations``.

It reads what it needs through a small protocol (``InstructionData``), not the datamodule's internals.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch

IGNORE_INDEX = -100


class InstructionData(Protocol):
    """What the evaluation reads: the held-out sequences (``gather``, ``labels`` = category codes),
    the category names, the raw held-out prompts and references, and the tokenizer."""

    categories: list[str]
    test_examples: list[dict[str, Any]]

    num_clients: int
    holdout_fraction: float

    def held_out(self) -> Any: ...

    def tokenizer(self) -> Any: ...

    def client_holdout_batch(self, client_id: int) -> dict[str, Any]: ...


class InstructionEvaluation(L.Callback):
    """Per-category response loss/perplexity and a ROUGE-L generation score at each evaluation.

    Args:
        num_samples: held-out prompts decoded per evaluation (the first ones), >= 0 (0: no generation).
        max_new_tokens: greedy decoding length, >= 1.
        batch_size: sequences per forward for the loss, >= 1.
        table_dir: where the generated-examples CSVs go (default: the first logger's log folder,
            else the trainer's ``default_root_dir``).
    """

    def __init__(self, num_samples: int = 32, max_new_tokens: int = 64, batch_size: int = 16, table_dir: str | None = None) -> None:
        if num_samples < 0:
            raise ValueError(f"InstructionEvaluation num_samples must be >= 0, got {num_samples}")
        if max_new_tokens < 1:
            raise ValueError(f"InstructionEvaluation max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size < 1:
            raise ValueError(f"InstructionEvaluation batch_size must be >= 1, got {batch_size}")
        self.num_samples, self.max_new_tokens, self.batch_size, self.table_dir = num_samples, max_new_tokens, batch_size, table_dir
        self._scorer = None
        self._fit_step: int | None = None  # the round of the last evaluation inside fit
        self.last_metrics: dict[str, float] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module.model, "generate", None)):
            raise ValueError(f"InstructionEvaluation needs a model with generate(); {type(pl_module.model).__name__} has none")
        if self.num_samples:
            try:
                from rouge_score import rouge_scorer
            except ImportError as error:
                raise ValueError("InstructionEvaluation's ROUGE-L needs rouge-score: pip install rouge-score (or num_samples: 0)") from error
            self._scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_generation_length(trainer, pl_module)  # after the model's own check of the data's lengths (its setup)

    def _check_generation_length(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A sampled prompt plus ``max_new_tokens`` longer than the model's positions: one line before anything runs."""
        positions = getattr(pl_module.model, "max_positions", None)
        data = trainer.datamodule
        if not self.num_samples or not isinstance(positions, int) or not getattr(data, "test_examples", None):
            return
        tokenizer = data.tokenizer()
        prompts = [e["prompt"] for e in data.test_examples[: self.num_samples]]
        longest = max(len(ids) for ids in tokenizer(prompts)["input_ids"])
        if longest + self.max_new_tokens > positions:
            raise ValueError(
                f"InstructionEvaluation max_new_tokens={self.max_new_tokens}: the longest sampled prompt has {longest} tokens "
                f"and the model has {positions} positions; set max_new_tokens <= {max(positions - longest, 0)} "
                "(or num_samples: 0 for no generation)"
            )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.evaluate(trainer, pl_module)
            self._fit_step = trainer.global_step

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._fit_step is not None and self._fit_step == trainer.global_step:
            # The test after fit (a validation split) of the model the fit's last evaluation measured at this very
            # round, on the same held-out examples: the same numbers, so the row is not logged a second time.
            self._publish(trainer, self.last_metrics)
            return
        self.evaluate(trainer, pl_module)

    # ---- the measurements ---------------------------------------------------------------
    @torch.no_grad()
    def _token_sums(self, pl_module: L.LightningModule, batch: dict[str, Any]) -> tuple[Any, Any]:
        """Per sequence: the summed response-token cross-entropy and the number of response tokens."""
        batch = {k: v.to(pl_module.device) for k, v in batch.items()}
        logits = pl_module.model(batch["input_ids"], batch["attention_mask"]).float()
        target = batch["labels"]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        return nll.view(target.shape).sum(1), (target != IGNORE_INDEX).sum(1)

    @torch.no_grad()
    def client_losses(self, pl_module: L.LightningModule, data: InstructionData) -> list[float]:
        """Every client's token-weighted response loss on its own held-out examples (``holdout_fraction``)."""
        losses = []
        for cid in range(data.num_clients):
            batch = data.client_holdout_batch(cid)
            if batch["input_ids"].shape[0] == 0:
                continue
            total, tokens = (t.sum().item() for t in self._token_sums(pl_module, batch))
            losses.append(total / max(tokens, 1))
        return losses

    @torch.no_grad()
    def category_losses(self, pl_module: L.LightningModule, data: InstructionData) -> dict[str, float]:
        """Token-weighted mean response loss, overall and per category (``{"": overall, name: ...}``)."""
        held_out = data.held_out()
        codes = held_out.labels
        totals: dict[int, list[float]] = {}
        was_training = pl_module.model.training
        pl_module.model.eval()
        try:
            for start in range(0, len(held_out), self.batch_size):
                index = torch.arange(start, min(start + self.batch_size, len(held_out)))
                per_example, tokens = self._token_sums(pl_module, held_out.gather(index))
                for code, s, n in zip(codes[index].tolist(), per_example.tolist(), tokens.tolist()):
                    entry = totals.setdefault(code, [0.0, 0])
                    entry[0], entry[1] = entry[0] + s, entry[1] + n
        finally:
            pl_module.model.train(was_training)
        total_loss, total_tokens = sum(v[0] for v in totals.values()), sum(v[1] for v in totals.values())
        names = data.categories or ["all"]
        out = {"": total_loss / max(total_tokens, 1)}
        if len(totals) > 1 or data.categories:
            out.update({names[c]: s / max(n, 1) for c, (s, n) in sorted(totals.items())})
        return out

    def generations(self, pl_module: L.LightningModule, data: InstructionData) -> list[dict[str, Any]]:
        """The first ``num_samples`` held-out examples with the model's greedy continuation and its ROUGE-L F1."""
        if not self.num_samples:
            return []
        examples = data.test_examples[: self.num_samples]
        texts = pl_module.model.generate(data.tokenizer(), [e["prompt"] for e in examples], self.max_new_tokens)
        rows = []
        for example, text in zip(examples, texts):
            score = self._scorer.score(example["reference"], text)["rougeL"].fmeasure
            rows.append({**example, "generated": text, "rougeL": score})
        return rows

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        data = trainer.datamodule
        metrics: dict[str, float] = {}
        for name, loss in self.category_losses(pl_module, data).items():
            suffix = f"/{name}" if name else ""
            metrics[f"eval/loss{suffix}"] = loss
            metrics[f"eval/ppl{suffix}"] = math.exp(min(loss, 50.0))
        if getattr(data, "holdout_fraction", 0.0) > 0:
            was_training = pl_module.model.training
            pl_module.model.eval()
            try:
                per_client = sorted(self.client_losses(pl_module, data), reverse=True)
            finally:
                pl_module.model.train(was_training)
            if per_client:
                ppl = [math.exp(min(v, 50.0)) for v in per_client]
                worst = ppl[: max(1, len(ppl) // 10)]
                metrics.update({"eval/clients/loss_mean": sum(per_client) / len(per_client),
                                "eval/clients/ppl_mean": sum(ppl) / len(ppl), "eval/clients/ppl_worst10": sum(worst) / len(worst)})  # fmt: skip
        rows = self.generations(pl_module, data)
        if rows:
            metrics["eval/rougeL"] = sum(r["rougeL"] for r in rows) / len(rows)
            metrics["eval/gen_samples"] = float(len(rows))
            metrics["eval/max_new_tokens"] = float(self.max_new_tokens)
        step = max(trainer.global_step - 1, 0)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            if rows:
                self._save_table(trainer, rows, step)
        self.last_metrics, self.last_rows = metrics, rows
        self._publish(trainer, metrics)
        return metrics

    @staticmethod
    def _publish(trainer: L.Trainer, metrics: dict[str, float]) -> None:
        """The metrics in ``trainer.callback_metrics``: the progress bar and the result line read them."""
        trainer.callback_metrics.update({k: torch.scalar_tensor(v) for k, v in metrics.items()})

    def _save_table(self, trainer: L.Trainer, rows: list[dict[str, Any]], step: int) -> None:
        folder = Path(self.table_dir) if self.table_dir else Path(
            next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), trainer.default_root_dir)
        )
        folder.mkdir(parents=True, exist_ok=True)
        columns = ["category", "prompt", "reference", "generated", "rougeL"]
        with open(folder / f"generations_round_{step}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="eval/generations", columns=columns, data=[[r[c] for c in columns] for r in rows], step=step)
