"""Offline hub failures end in one line naming the setting to change and HF_HUB_OFFLINE (exit code 2),
within seconds when HF_HUB_OFFLINE=1 (huggingface_hub reads the switch at import: subprocesses)."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python(*args: str, timeout: int = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def test_missing_base_model_is_one_line_naming_the_setting(tmp_path):
    proc, seconds = _python("-m", "fl_lightning.commands.cli", "fit", "--config", str(ROOT / "configs" / "fedit_gpt2_sst2.yaml"),
                            "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
                            "--model.model.init_args.model_name_or_path", "no-such-org/no-such-model")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fl-lightning: error: model.model.init_args.model_name_or_path='no-such-org/no-such-model'")
    assert "HF_HUB_OFFLINE" in line and "local directory" in line
    assert seconds < 60


def _raises(code: str) -> str:
    proc, _ = _python("-c", f"{code}\nraise SystemExit('no error')")
    assert proc.returncode == 1
    return proc.stderr.strip().splitlines()[-1]


def test_missing_tokenizer_and_dataset_name_their_settings():
    tokenizer = _raises("from datamodules.text import load_tokenizer\nload_tokenizer('no-such-org/no-such-tokenizer')")
    assert tokenizer.startswith("ValueError: data.init_args.tokenizer='no-such-org/no-such-tokenizer': cannot load the tokenizer")
    assert "HF_HUB_OFFLINE" in tokenizer
    dataset = _raises("from datamodules import TextDataModule\n"
                      "TextDataModule(task='sst2', dataset_path='no-such-org/no-such-data')._load_raw()")  # fmt: skip
    assert dataset.startswith("ValueError: data.init_args.dataset_path='no-such-org/no-such-data': cannot load the sst2 dataset")
    assert "data.init_args.data_files" in dataset and "HF_HUB_OFFLINE" in dataset


def test_missing_image_dataset_is_one_line_naming_the_setting(tmp_path):
    """An image config offline (CIFAR-10 not downloaded): one line naming data.init_args.dataset_args.path and the
    offline switch, exit code 2, not datasets' ConnectionError traceback."""
    proc, seconds = _python("-m", "fl_lightning.commands.cli", "fit", "--config", str(ROOT / "configs" / "fadam_cifar10.yaml"),
                            "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
                            "--data.init_args.dataset_args", '{"path": "no-such-org/no-such-images", "cache_dir": "' + str(tmp_path) + '"}')  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fl-lightning: error: data.init_args.dataset_args.path='no-such-org/no-such-images': cannot load the cifar10 dataset")
    assert "HF_HUB_OFFLINE" in line and "data_files" in line
    assert seconds < 60
