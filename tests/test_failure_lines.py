"""Issue 26: failures of the machine and silent cases end in one line naming the cause and what
to do (exit code 2): full, size-limited and read-only folders for checkpoints, client stores and
metrics; damaged checkpoints; a loss that grows by orders of magnitude; a resume with nothing to train."""

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning.reliability import checkpoint_io
from fl_lightning.commands.cli import main
from fl_lightning.core.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).with_name("fl-lightning"))
LIMIT = 64_000  # bytes: above a run's config.yaml (3 KB), below a quickstart checkpoint (160 KB) or client state


def _args(tmp_path: Path, rounds: int = 2, every: int = 1, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
        "--trainer.max_steps", str(rounds), "--trainer.val_check_interval", str(rounds),
        "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "root"),
        "--trainer.callbacks", "ModelCheckpoint", "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"),
        "--trainer.callbacks.save_last", "true", "--trainer.callbacks.save_top_k", "0",
        "--trainer.callbacks.every_n_train_steps", str(every),
        "--data.init_args.num_clients", "8", "--data.init_args.participation.init_args.clients_per_round", "3",
        "--model.local.steps", "2", *extra,
    ]  # fmt: skip


def _one_line(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("fl-lightning: error: "), err
    assert not any(line.startswith("Traceback") for line in err), err
    return err[-1].removeprefix("fl-lightning: error: ")


def _limited_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """The real command with a file-size limit (``ulimit -f``): writes past it fail with EFBIG."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error from write(), not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [EXE, *_args(tmp_path, 2, 1, *extra)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)


# ---- checkpoints --------------------------------------------------------------------------------------
def test_a_checkpoint_past_the_file_size_limit_is_one_line_naming_the_folder(tmp_path):
    run = _limited_run(tmp_path)
    assert run.returncode == 2, run.stderr[-3000:]
    err = run.stderr.strip().splitlines()
    folder = tmp_path / "ckpt"
    assert err[-1].startswith(
        f"fl-lightning: error: cannot write the checkpoint last.ckpt: file too large for {folder} "
        "(the process's file-size limit `ulimit -f` is 64.0 KB, or the file system's, needs about "
    ), err[-1]
    assert err[-1].endswith("no checkpoint was written before this one; raise the limit or write to another folder")
    assert "Traceback" not in run.stderr and list(folder.iterdir()) == []  # no half-written temporary left


def test_disk_full_at_a_later_checkpoint_names_the_intact_last_one(tmp_path, capsys, monkeypatch):
    writes = []
    write = checkpoint_io._HashingWriter.write

    def full_disk(self, data):  # the device fills up during the second checkpoint
        if len(writes) and self is not writes[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if not writes:
            writes.append(self)
        return write(self, data)

    monkeypatch.setattr(checkpoint_io._HashingWriter, "write", full_disk)
    line = _one_line(capsys, _args(tmp_path, 3))
    last = tmp_path / "ckpt" / "last.ckpt"
    assert line.startswith(f"cannot write the checkpoint last.ckpt: no space left on the device of {last.parent} (")
    assert " free, needs about " in line
    assert line.endswith(f"the last good checkpoint {last} is intact (resume with --ckpt_path {last}); free space there or write to another folder")
    checkpoint_io.verify(last)
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]


def test_a_read_only_checkpoint_folder_is_one_line(tmp_path, capsys, monkeypatch):
    def read_only(path, *args, **kwargs):  # root ignores permission bits: the file system's answer, injected
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(checkpoint_io, "open", read_only, raising=False)
    line = _one_line(capsys, _args(tmp_path))
    assert line == (
        f"cannot write the checkpoint last.ckpt: {tmp_path / 'ckpt'} is not writable (Read-only file system); "
        "no checkpoint was written before this one; make it writable or write to another folder"
    )


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, capsys):
    main(_args(tmp_path, 2))
    capsys.readouterr()
    last = tmp_path / "ckpt" / "last.ckpt"
    checkpoint_io.verify(last)  # intact: accepted
    data = bytearray(last.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    last.write_bytes(bytes(data))
    line = _one_line(capsys, _args(tmp_path, 4) + ["--ckpt_path", str(last)])
    assert line == (
        f"checkpoint {last} is damaged: its SHA-256 differs from the one recorded when it was written "
        "(modified or corrupted on disk); resume from another checkpoint, or start without --ckpt_path"
    )


def test_a_checkpoint_without_a_checksum_has_its_archive_crcs_checked(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)  # as Lightning's own writer does
    checkpoint_io.verify(path)
    data = bytearray(path.read_bytes())
    start = data.find(torch.arange(4096, dtype=torch.float32).numpy().tobytes()[:64])
    data[start + 100 : start + 164] = bytes(64)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is damaged: the archive's CRC of .* does not match"):
        checkpoint_io.verify(path)


def test_a_resume_at_or_past_max_steps_is_one_line(tmp_path, capsys):
    main(_args(tmp_path, 2))
    capsys.readouterr()
    last = tmp_path / "ckpt" / "last.ckpt"
    line = _one_line(capsys, _args(tmp_path, 2) + ["--ckpt_path", str(last)])
    assert line == (
        f"the checkpoint {last} already holds 2 rounds, at or past --trainer.max_steps 2: nothing to train; "
        "raise --trainer.max_steps above 2 to continue it, or evaluate it with `fl-lightning test --ckpt_path ...`"
    )


# ---- client store and metrics ---------------------------------------------------------------------------
def test_a_client_store_past_the_file_size_limit_is_one_line(tmp_path):
    store = tmp_path / "store"
    run = _limited_run(
        tmp_path, "--model.algorithm", "SCAFFOLD", "--model.store", "DiskClientStore", "--model.store.directory", str(store)
    )
    assert run.returncode == 2, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("fl-lightning: error: cannot write the DiskClientStore table file ")
    assert f".table: file too large for {store / 'live'} (the process's file-size limit `ulimit -f` is 64.0 KB" in line
    assert "previous state and the last checkpoint are intact; raise the limit or write to another folder" in line
    assert "Traceback" not in run.stderr and not list((store / "live").glob("*.tmp"))


def test_a_full_metrics_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_ExperimentWriter, "save", full)
    args = _args(tmp_path) + ["--trainer.logger", "CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "logs")]
    line = _one_line(capsys, args)
    folder = tmp_path / "logs" / "lightning_logs" / "version_0"
    assert line.startswith(f"cannot write the metrics file metrics.csv: no space left on the device of {folder} (")
    assert line.endswith("the metrics logged so far are in memory only; free space there or write to another folder")


# ---- divergence by growth ------------------------------------------------------------------------------
DIVERGING = ["--model.algorithm.init_args.global_lr", "1e3", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"]


def test_a_loss_growing_by_orders_of_magnitude_is_reported(tmp_path, capsys, caplog):
    main(_args(tmp_path, 3) + DIVERGING)
    warnings = [r.getMessage() for r in caplog.records if "the run is diverging" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("round 1: the mean training loss "), warnings
    assert "x the first round's (" in warnings[0] and "faults.max_loss_growth stops such a run" in warnings[0]


def test_max_loss_growth_stops_the_run_in_one_line(tmp_path, capsys):
    line = _one_line(capsys, _args(tmp_path, 3) + DIVERGING + ["--model.faults.max_loss_growth", "100"])
    assert line.startswith("round 1: the mean training loss ") and "more than faults.max_loss_growth = 100" in line
    assert line.endswith("no checkpoint was written; lower local.lr or the algorithm's global_lr")


def test_max_loss_growth_must_exceed_one(capsys):
    from fl_lightning.reliability.faults import ClientFaults

    with pytest.raises(ValueError, match=r"faults.max_loss_growth must be > 1 \(a multiple of the first round's loss\) or null, got 0.5"):
        ClientFaults(max_loss_growth=0.5)


# ---- metrics of a run killed with SIGKILL and resumed ---------------------------------------------------
def _metrics_args(logs: Path, rounds: int = 16) -> list[str]:
    return [
        "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
        "--trainer.max_steps", str(rounds), "--trainer.val_check_interval", "4", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(logs),
        "--trainer.callbacks", "ModelCheckpoint", "--trainer.callbacks.save_last", "true",
        "--trainer.callbacks.save_top_k", "0", "--trainer.callbacks.every_n_train_steps", "2",
        "--data.init_args.num_clients", "8", "--data.init_args.participation.init_args.clients_per_round", "3",
        "--model.local.steps", "2",
    ]  # fmt: skip


def _rows(path: Path) -> list[tuple]:
    import csv

    with open(path, newline="") as file:
        rows = [{k: v for k, v in row.items() if v != "" and not k.startswith("time/")} for row in csv.DictReader(file)]
    return sorted(tuple(sorted(row.items())) for row in rows)


def test_a_run_killed_with_sigkill_and_resumed_logs_every_round_exactly_once(tmp_path):
    main(_metrics_args(tmp_path / "straight"))  # the uninterrupted run's metrics.csv
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    version = tmp_path / "killed" / "quickstart" / "version_0"
    last = version / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen([EXE, *_metrics_args(tmp_path / "killed")], cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    import time

    deadline = time.time() + 300
    while not last.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 2 <= killed_at < 16, f"the kill landed outside the run (checkpoint at round {killed_at})"
    resumed = subprocess.run(
        [EXE, *_metrics_args(tmp_path / "killed"), "--ckpt_path", str(last)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = _rows(tmp_path / "straight" / "quickstart" / "version_0" / "metrics.csv")
    assert sorted(int(dict(r)["step"]) for r in expected if "train/loss" in dict(r)) == list(range(16))
    assert _rows(version / "metrics.csv") == expected
    assert "Previous log files in this directory will be deleted" not in resumed.stderr
