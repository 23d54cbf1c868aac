"""Export the global model in its library's own format (e.g. a peft adapter).

Any model with ``save_pretrained(path)`` can be exported; for ``models.LoRAClassifier``
that writes the global LoRA adapter and head, loadable with
``peft.PeftModel.from_pretrained(base_model, path)``, with the classifier's ``config.json``
(``num_labels``, ``pad_token_id``) and, when the datamodule tokenizes text, the tokenizer
(with its pad token) beside it, so that

    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoPeftModelForSequenceClassification.from_pretrained(
        path, num_labels=config.num_labels, pad_token_id=config.pad_token_id)
    model(**tokenizer(texts, padding=True, return_tensors="pt")).logits

works on padded batches.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L


def export_pretrained(module: L.LightningModule, dirpath: str | Path, datamodule=None) -> Path:
    """Write ``module.model`` (the current global model) with its ``save_pretrained``, and the
    datamodule's tokenizer (if it has one: ``tokenizer_name``) with its pad token."""
    model = module.model
    if not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(f"export needs a model with save_pretrained(path); {type(model).__name__} has none")
    path = Path(dirpath)
    path.mkdir(parents=True, exist_ok=True)
    lora = getattr(module, "lora", None)
    if lora is not None and lora.method.folds:  # the frozen weights changed: the adapter needs its base (docs/lora.md)
        model.save_pretrained(path, with_base=True)
    else:
        model.save_pretrained(path)
    tokenizer_name = getattr(datamodule, "tokenizer_name", None)
    if tokenizer_name:
        from fl_lightning.datamodules.text import load_tokenizer

        load_tokenizer(tokenizer_name, getattr(datamodule, "trust_remote_code", False)).save_pretrained(str(path))
    return path


class ExportPretrained(L.Callback):
    """Export the global model at the end of ``fit`` (and of ``validate``/``test``, so
    ``fl-lightning validate --ckpt_path X`` exports a checkpoint's model).

    Args:
        dirpath: output directory (created); ``None`` (the default): ``adapter`` in the run's folder (the
            first logger's ``<save_dir>/<name>/version_N``, else ``trainer.default_root_dir``), beside its
            ``metrics.csv`` and checkpoints. With ``every_n_rounds`` a ``round_<r>`` subdirectory is added
            per intermediate export.
        every_n_rounds: also export every that many rounds (``None``: only at the end).

    ``exported`` holds the folder of the last export (``fl-lightning fit`` names it in its result line).
    """

    def __init__(self, dirpath: str | None = None, every_n_rounds: int | None = None) -> None:
        if every_n_rounds is not None and every_n_rounds < 1:
            raise ValueError(f"ExportPretrained every_n_rounds must be >= 1 or null, got {every_n_rounds}")
        self.dirpath, self.every_n_rounds = dirpath, every_n_rounds
        self.exported: Path | None = None

    def folder(self, trainer: L.Trainer) -> Path:
        """Where the export goes: ``dirpath``, else ``adapter`` in the run's folder."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        run_dir = next((lg.log_dir for lg in trainer.loggers if getattr(lg, "log_dir", None)), None) or trainer.default_root_dir
        return Path(run_dir) / "adapter"

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module.model, "save_pretrained", None)):
            raise ValueError(
                f"ExportPretrained needs a model with save_pretrained(path); {type(pl_module.model).__name__} has none"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_rounds and trainer.global_step % self.every_n_rounds == 0 and trainer.is_global_zero:
            export_pretrained(pl_module, self.folder(trainer) / f"round_{trainer.global_step}", trainer.datamodule)

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.exported = export_pretrained(pl_module, self.folder(trainer), trainer.datamodule)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._export(trainer, pl_module)

    def on_test_end(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module)
