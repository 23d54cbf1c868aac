"""Safe loading: the CLI resumes with weights_only=True, so a checkpoint that needs arbitrary
unpickling is refused; client state is plain tensors; remote code is never trusted by default."""

import inspect
from pathlib import Path

import pytest
import torch

from fl_lightning.commands.cli import main
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Stands for anything a malicious checkpoint could ask pickle to build."""


def test_a_checkpoint_needing_unpickling_is_refused(tmp_path, monkeypatch, capsys):
    module, trainer = tiny_module(), tiny_trainer(tmp_path, rounds=1)
    trainer.fit(module, datamodule=tiny_datamodule())
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    checkpoint = torch.load(tmp_path / "good.ckpt", weights_only=True)  # everything we write loads safely
    assert all(isinstance(v, torch.Tensor) for v in checkpoint["federated"]["client_store"].values())
    checkpoint["extra"] = Payload()
    torch.save(checkpoint, tmp_path / "evil.ckpt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:  # refused, one line, exit code 2 (the object is never built)
        main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "2",
              "--trainer.logger", "false", "--ckpt_path", str(tmp_path / "evil.ckpt")])  # fmt: skip
    assert stopped.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "weights-only load refuses (Weights only load failed" in message


def test_remote_code_is_not_trusted_by_default():
    from models.gpt2_lora import LoRAClassifier

    assert inspect.signature(LoRAClassifier).parameters["trust_remote_code"].default is False
