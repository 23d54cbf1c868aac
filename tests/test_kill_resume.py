"""A run killed with SIGKILL mid-training and resumed from last.ckpt ends with the same
final model, server state and client store as an uninterrupted run (bitwise)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, EVERY = 16, 2
FAST_ROUNDS = 40  # the logistic configs run rounds faster than a kill can land
CONFIGS = {  # config -> extra CLI arguments
    "quickstart": [],
    "scaffold_digits": [],
    "fadam_gt_digits": [],
    "personalization_logistic": ["--model.algorithm", "fl_lightning.algorithms.ScaffoldP"],  # Scaffold-P
    # Scaffold-P with every client's state, personal tensors included, on disk ({store}: a new folder per process)
    "personalization_logistic+disk": [
        "--model.algorithm", "fl_lightning.algorithms.ScaffoldP",
        "--model.store", "fl_lightning.core.state.DiskClientStore", "--model.store.directory", "{store}",
    ],
    # SCAFFOLD with top-k uploads and QSGD broadcast changes, error feedback on both links: the clients'
    # residuals on disk, the server's copies of the broadcast in the checkpoint (docs/algorithms.md, 21)
    "fedavg_topk_digits+scaffold+disk": [
        "--model.algorithm", "fl_lightning.algorithms.SCAFFOLD",
        "--model.compression.down", "fl_lightning.compression.QSGD", "--model.compression.down.levels", "4",
        "--model.store", "fl_lightning.core.state.DiskClientStore", "--model.store.directory", "{store}",
    ],
    # FedBuff under the simulated clock: clients in flight, their model versions and the clock in the checkpoint
    "fedbuff_digits": ["--model.asynchronous.concurrency", "4", "--model.asynchronous.buffer_size", "2"],
}  # fmt: skip


def _command(config: Path, run_dir: Path, ckpt: Path | None = None, extra: tuple[str, ...] = (), rounds: int = ROUNDS) -> list[str]:
    exe = Path(sys.executable).with_name("fl-lightning")
    extra = tuple(a.format(store=run_dir / ("store-resumed" if ckpt else "store")) for a in extra)
    args = [
        str(exe), "fit", "--config", str(config),
        "--trainer.max_steps", str(rounds), "--trainer.val_check_interval", str(rounds),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(run_dir), "--trainer.callbacks.save_last", "true",
        "--trainer.callbacks.save_top_k", "0", "--trainer.callbacks.every_n_train_steps", str(EVERY),
        "--data.init_args.num_clients", "8", "--data.init_args.participation.init_args.clients_per_round", "3",
        "--model.local.steps", "2",
    ]  # fmt: skip
    return args + list(extra) + (["--ckpt_path", str(ckpt)] if ckpt else [])


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}


def _step_of(ckpt: Path) -> int:
    try:
        return torch.load(ckpt, weights_only=True)["global_step"]
    except Exception:  # not written yet, or being written
        return -1


def _federated_state(ckpt: Path) -> dict:
    c = torch.load(ckpt, weights_only=True)
    store = c["federated"]["client_store"]
    if "disk_snapshot" in store:  # a DiskClientStore's checkpoint names its snapshot: compare its clients' tensors
        from fl_lightning.core.state import DiskClientStore

        reader = DiskClientStore(str(ckpt.parent / f"read-{ckpt.parent.name}"))  # the snapshot, checked and loaded
        reader.load_checkpoint_state(store)
        store = reader.state_dict()
        reader.close()
    federated = {**c["federated"], "client_store": store}
    return {"model": c["state_dict"], **{f"fl/{k}": v for k, v in federated.items()}, "opt": c["optimizer_states"]}


def _assert_equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sigkill_and_resume_equals_uninterrupted(tmp_path, name):
    config, extra = ROOT / "configs" / f"{name.split('+')[0]}.yaml", tuple(CONFIGS[name])
    rounds = FAST_ROUNDS if name.startswith("personalization") else ROUNDS
    straight = subprocess.run(_command(config, tmp_path / "a", extra=extra, rounds=rounds), cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr[-3000:]

    proc = subprocess.Popen(_command(config, tmp_path / "b", extra=extra, rounds=rounds), cwd=tmp_path, env=_env(), stderr=subprocess.PIPE)
    last = tmp_path / "b" / "last.ckpt"
    deadline = time.time() + 600
    while not last.exists() and proc.poll() is None and time.time() < deadline:  # the first checkpoint is round EVERY's
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = _step_of(last)
    assert EVERY <= killed_at < rounds, f"kill landed outside the run (checkpoint at {killed_at})"

    resumed = subprocess.run(_command(config, tmp_path / "b", ckpt=last, extra=extra, rounds=rounds), cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _step_of(tmp_path / "a" / "last.ckpt") == _step_of(last) == rounds
    _assert_equal(_federated_state(tmp_path / "a" / "last.ckpt"), _federated_state(last))
