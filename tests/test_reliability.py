"""Issue 20: known failures end in one line plus a hint (exit code 2), checked resumes,
and a client store that owns its folder."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fl_lightning.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "2", "--trainer.logger", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", "2",
]  # fmt: skip


def _cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *QUICK, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("fl-lightning: error: "), err
    return err[-1]


def test_a_model_that_does_not_fit_the_data_ends_in_one_line(tmp_path, capsys):
    """in_channels 3 on 1-channel digits: was 'trains 0 clients for 30 rounds and exits 0'."""
    line = _cli_error(
        capsys, "--model.model.init_args.in_channels", "3", "--trainer.callbacks", "[]",
        "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert "round 0: client" in line and "not a client fault" in line and "in_channels" in line


# ---- checked resumes (defect 5) ----------------------------------------------------------------------
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from fl_lightning import FedAvg, FederatedModule, LocalTraining  # noqa: E402
from fl_lightning.adversary import Attack, SignFlip  # noqa: E402
from fl_lightning.algorithms import SCAFFOLD  # noqa: E402
from fl_lightning.robust.aggregation import Robust  # noqa: E402
from fl_lightning.core.errors import FLError  # noqa: E402
from models import MLP  # noqa: E402
from tests.conftest import tiny_datamodule, tiny_trainer  # noqa: E402


def _fit(tmp_path, algorithm, rounds, num_clients=6, hidden=16, ckpt_path=None, data_seed=0, **settings):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[hidden]), algorithm, LocalTraining(lr=0.1, steps=2, batch_size=8), **settings)
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[callback])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients, 3, seed=data_seed), ckpt_path=ckpt_path)
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.parametrize(
    "first, then, message",
    [
        (dict(algorithm=SCAFFOLD, num_clients=6), dict(algorithm=SCAFFOLD, num_clients=7), "num_clients: 6 in the checkpoint, 7 in this run"),
        (dict(algorithm=SCAFFOLD), dict(algorithm=FedAvg), "algorithm: fl_lightning.algorithms.scaffold.SCAFFOLD .*in the checkpoint, fl_lightning.algorithms.fedavg.FedAvg"),
        (dict(algorithm=FedAvg), dict(algorithm=SCAFFOLD), "algorithm: fl_lightning.algorithms.fedavg.FedAvg .*in the checkpoint, fl_lightning.algorithms.scaffold.SCAFFOLD"),
        (dict(algorithm=FedAvg), dict(algorithm=FedAvg, hidden=12), "model parameters: net.1.weight \\[16, 8\\] in the checkpoint, \\[12, 8\\] in this run"),
        (dict(algorithm=FedAvg), dict(algorithm=FedAvg, data_seed=1), "partition: the checkpoint's clients hold other samples"),
        (
            dict(algorithm=FedAvg, robust=Robust(rule="median")), dict(algorithm=FedAvg, robust=Robust(rule="trimmed_mean", beta=0.2)),
            "model.robust: Robust\\(.*rule='median'.*\\) in the checkpoint, Robust\\(beta=0.2, .*rule='trimmed_mean'.*\\) in this run",
        ),
        (
            dict(algorithm=FedAvg, attack=Attack(clients=[0], upload=SignFlip())), dict(algorithm=FedAvg),
            "model.attack: Attack\\(clients=\\[0\\], data=None, fraction=0.0, upload=SignFlip\\(.*\\)\\) in the checkpoint, None in this run",
        ),
    ],
)
def test_a_resume_that_does_not_match_its_checkpoint_stops_naming_what_differs(tmp_path, first, then, message):
    first, then = dict(first), dict(then)
    ckpt = _fit(tmp_path / "a", first.pop("algorithm")(), 2, **first)
    with pytest.raises(FLError, match=f"^checkpoint .*last.ckpt does not match this run: {message}") as info:
        _fit(tmp_path / "b", then.pop("algorithm")(), 4, ckpt_path=ckpt, **then)
    assert "\n" not in str(info.value)


def test_a_matching_resume_and_an_old_checkpoint_without_fingerprint_load(tmp_path):
    ckpt = _fit(tmp_path / "a", SCAFFOLD(), 2)
    assert torch.load(ckpt, weights_only=True)["federated"]["fingerprint"]["num_clients"] == 6
    _fit(tmp_path / "b", SCAFFOLD(), 3, ckpt_path=ckpt)
    old = torch.load(ckpt, weights_only=True)
    del old["federated"]["fingerprint"]
    torch.save(old, tmp_path / "old.ckpt")
    _fit(tmp_path / "c", SCAFFOLD(), 3, ckpt_path=tmp_path / "old.ckpt")


# ---- settings named in one line (issue 20, item 7) -----------------------------------------------------
from datamodules import FederatedDataModule  # noqa: E402


def test_a_negative_data_seed_is_named():
    with pytest.raises(ValueError, match="^data.seed must be an integer >= 0, got -1$"):
        FederatedDataModule(dataset="synthetic", seed=-1)


def test_unknown_dataset_args_are_named_with_the_allowed_keys():
    with pytest.raises(ValueError, match="^data.dataset_args: unknown key 'bogus' for dataset 'synthetic'; allowed: \\[.*'num_samples'"):
        FederatedDataModule(dataset="synthetic", dataset_args={"bogus": 1})


def test_val_check_interval_0_is_named(tmp_path, capsys):
    line = _cli_error(capsys, "--trainer.val_check_interval", "0", "--trainer.default_root_dir", str(tmp_path))
    assert line == "fl-lightning: error: trainer.val_check_interval must be > 0 (rounds between evaluations, or a fraction in (0, 1]), got 0"


@pytest.mark.parametrize("name", ["..", ".", "../..", "/.."])
def test_a_run_name_never_leaves_the_runs_folder(tmp_path, name):
    from fl_lightning.experiments.sweep import Sweep, dir_name

    run_dir = Sweep(path=tmp_path, base=tmp_path, runs={name: {}}).run_dir(tmp_path / "out", name, 0)
    assert run_dir.resolve().parent.parent == (tmp_path / "out" / "runs").resolve(), dir_name(name)


# ---- metrics across resumes (defect 6) -------------------------------------------------------------
import csv  # noqa: E402

from lightning.pytorch.loggers import CSVLogger  # noqa: E402


def _logged_fit(tmp_path, rounds, ckpt_path=None):
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8))
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=2)
    trainer = tiny_trainer(
        tmp_path, rounds, enable_checkpointing=True, callbacks=[callback], logger=CSVLogger(tmp_path, name="logs", version=0),
        limit_val_batches=1.0, val_check_interval=2, check_val_every_n_epoch=None,
    )  # fmt: skip
    trainer.fit(module, datamodule=tiny_datamodule(6, 3), ckpt_path=ckpt_path)
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_a_resume_into_the_same_logger_version_continues_its_metrics_without_gaps_or_duplicates(tmp_path):
    straight = _logged_fit(tmp_path / "a", 6)
    _logged_fit(tmp_path / "b", 5)  # "killed" after round 5; its last checkpoint is round 4's
    ckpt = tmp_path / "b" / "ckpt" / "epoch=0-step=4.ckpt"
    resumed = _logged_fit(tmp_path / "b", 6, ckpt_path=ckpt)
    key = lambda rows: [(r["step"], r.get("round"), r.get("train/loss"), r.get("val/acc")) for r in rows]  # noqa: E731
    assert key(resumed) == key(straight)


# ---- --ckpt_path: `last`, missing and damaged files end in one line -------------------------------------------
def _cli_line(tmp_path, *args):
    exe = Path(sys.executable).with_name("fl-lightning")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(exe), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_ckpt_path_last_resumes_the_newest_checkpoint_of_the_experiment(tmp_path):
    common = ["--trainer.val_check_interval", "2", "--trainer.callbacks.init_args.every_n_train_steps", "2"]
    none_yet = _cli_line(tmp_path, "--trainer.max_steps", "2", *common, "--ckpt_path", "last")
    assert none_yet.returncode == 2 and len(none_yet.stderr.strip().splitlines()) == 1
    assert "--ckpt_path last: this experiment has no checkpoint yet" in none_yet.stderr
    assert _cli_line(tmp_path, "--trainer.max_steps", "2", *common).returncode == 0
    resumed = _cli_line(tmp_path, "--trainer.max_steps", "4", *common, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    last = tmp_path / "runs" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4  # continued from round 2, in the same version
    assert not (tmp_path / "runs" / "quickstart" / "version_1").exists()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_damaged_checkpoint_is_one_line(tmp_path, damage):
    ckpt = tmp_path / "x.ckpt"
    if damage == "truncated":
        torch.save({"a": torch.zeros(1000)}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:500])
    proc = _cli_line(tmp_path, "--trainer.max_steps", "2", "--ckpt_path", str(ckpt))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert ("no such checkpoint file" if damage == "missing" else "not a readable checkpoint") in proc.stderr


def test_an_empty_config_is_named_and_debug_shows_the_traceback(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(empty)])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"fl-lightning: error: config {empty} is empty; see `fl-lightning fit --print_config` for every setting"
    )
    with pytest.raises(ValueError, match="is empty"):  # --debug: the error itself, with its traceback
        main(["fit", "--config", str(empty), "--debug"])


def test_sigterm_stops_a_long_round_within_one_local_step(tmp_path):
    exe = Path(sys.executable).with_name("fl-lightning")
    err = tmp_path / "err.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [str(exe), "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.local.steps", "100000",
             "--trainer.max_steps", "2", "--trainer.logger", "false"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
        deadline = time.time() + 120
        while "round 0/2" not in err.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)  # the round's progress bar is drawn: local training is under way
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        stopped_at = time.time()
        code = proc.wait(timeout=60)
    assert code == 143 and time.time() - stopped_at < 20
    last = err.read_text().replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("fl-lightning: error: round 0: stopped by SIGTERM during client ") and "resume with --ckpt_path " in last


# ---- a bound on local work per client, checked before any training ---------------------------------------------
def test_huge_local_steps_are_named_with_the_allowed_range_before_training(tmp_path, capsys):
    """local.steps 1e9: was a multi-GB index matrix, then a memory error or a hang that ignored SIGTERM."""
    started = time.time()
    line = _cli_error(capsys, "--model.local.steps", "1000000000", "--trainer.default_root_dir", str(tmp_path))
    assert line == "fl-lightning: error: local.steps must be in [1, 100000] (local steps per client per round), got 1000000000"
    assert time.time() - started < 60


def test_huge_local_epochs_times_client_size_are_named_before_training(tmp_path, capsys):
    """local.epochs x ceil(client size / batch_size) over the bound: the largest client is named, before round 0."""
    line = _cli_error(
        capsys, "--model.local.steps", "null", "--model.local.epochs", "1000000", "--model.local.batch_size", "1",
        "--trainer.default_root_dir", str(tmp_path),
    )  # fmt: skip
    assert line.startswith("fl-lightning: error: local.epochs=1000000 gives ") and "local steps per round for client " in line
    assert "must be <= 100000 (lower local.epochs or raise local.batch_size)" in line
    assert not list(tmp_path.rglob("*.ckpt"))


def test_the_local_step_batches_do_not_gather_every_step_at_once():
    """The in-memory fast path gathered all K steps' samples in one tensor (K x B x sample size)."""
    import datamodules.federated as federated

    data = tiny_datamodule(2, 2)
    data.setup("fit")
    gathered = []
    original = federated.gather_rows  # the in-memory gather (one index_select of a [steps, B] index)

    def spy(tensor, index):
        gathered.append(index.shape[0] if index.dim() == 2 else 1)
        return original(tensor, index)

    federated.gather_rows = spy
    try:
        batches = list(data.client_batches(0, seed=1, batch_size=2, steps=5000))
    finally:
        federated.gather_rows = original
    assert len(batches) == 5000 and gathered and max(gathered) <= 1024


# ---- SIGTERM / SIGINT: stop within one local step, ending with a checkpoint of the last completed round -------
def test_a_stop_signal_ends_with_a_checkpoint_that_resumes_bitwise(tmp_path):
    """SIGTERM (exit 143) and SIGINT (130), each sent mid-round to its own run, against one uninterrupted run."""
    from tests.test_kill_resume import _assert_equal, _command, _env, _federated_state, _step_of

    # an even number of rounds: the periodic checkpoint (every 2 rounds) then holds the straight run's final round
    config, rounds, slow = ROOT / "configs" / "quickstart.yaml", 4, ("--model.local.steps", "400")
    straight = subprocess.run(_command(config, tmp_path / "straight", extra=slow, rounds=rounds), env=_env(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-2000:]
    for signum, code in [(signal.SIGTERM, 143), (signal.SIGINT, 130)]:
        run_dir = tmp_path / f"stopped-{code}"
        last = run_dir / "last.ckpt"
        proc = subprocess.Popen(_command(config, run_dir, extra=slow, rounds=rounds), env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.time() + 300
        while _step_of(last) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)  # the periodic checkpoint of round 2 exists: round 3 (or 4) is under way
        time.sleep(1.0)
        proc.send_signal(signum)
        stopped_at = time.time()
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == code and time.time() - stopped_at < 30, stderr[-2000:]
        line = stderr.strip().splitlines()[-1]
        name = signal.Signals(signum).name
        assert line.startswith("fl-lightning: error: round ") and f"stopped by {name}" in line, line
        completed = _step_of(last)
        assert 2 <= completed < rounds and f"wrote the checkpoint of the {completed} completed rounds: {last}; resume with --ckpt_path {last}" in line, line
        resumed = subprocess.run(_command(config, run_dir, ckpt=last, extra=slow, rounds=rounds), env=_env(),
                                 capture_output=True, text=True, timeout=600)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        _assert_equal(_federated_state(last), _federated_state(tmp_path / "straight" / "last.ckpt"))


from lightning.pytorch import Callback  # noqa: E402


class SigtermAfterRound2(Callback):
    """SIGTERM between rounds: Lightning raises SIGTERMException, a SystemExit with code 0 without the CLI's care."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            trainer._signal_connector.received_sigterm = True


def test_sigterm_between_rounds_ends_with_a_checkpoint_and_exit_143(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *QUICK[:2], "--trainer.max_steps", "4", "--trainer.logger", "false", "--trainer.enable_progress_bar",
              "false", "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks+", "tests.test_reliability.SigtermAfterRound2"])  # fmt: skip
    assert stopped.value.code == 143
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"  # a run without a logger keeps its own version folder
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fl-lightning: error: round 2: stopped by SIGTERM before the round started; "
        f"wrote the checkpoint of the 2 completed rounds: {last}; resume with --ckpt_path {last}"
    )
    assert torch.load(last, weights_only=True)["global_step"] == 2


# ---- checkpoint writes: streamed beside the target, no full copies in memory or in the temp directory ----------
def test_a_checkpoint_write_leaves_no_temporary_file_outside_its_folder(tmp_path, monkeypatch):
    """Lightning's write went through an fsspec temporary file in the system temp directory (tmpfs: RAM),
    left behind, full size, by a killed run."""
    import tempfile

    made = []
    original = tempfile.mkstemp
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: made.append(a) or original(*a, **k))
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer = tiny_trainer(tmp_path, 2, enable_checkpointing=True, callbacks=[callback])
    trainer.fit(FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8)),
                datamodule=tiny_datamodule(6, 3))  # fmt: skip
    assert (tmp_path / "ckpt" / "last.ckpt").is_file() and not made
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_temporary_checkpoint_files_of_killed_runs_are_removed_on_the_next_start(tmp_path):
    import socket

    from fl_lightning.reliability.checkpoint_io import temporary_name

    folder = tmp_path / "ckpt"
    folder.mkdir()
    host = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        stale, live = folder / temporary_name("last.ckpt", host, dead.pid), folder / temporary_name("last.ckpt", host, alive.pid)
        other_host = folder / temporary_name("last.ckpt", "elsewhere", dead.pid)
        for path in (stale, live, other_host):
            path.write_bytes(b"partial")
        callback = ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=1)
        trainer = tiny_trainer(tmp_path, 1, enable_checkpointing=True, callbacks=[callback])
        trainer.fit(FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8)),
                    datamodule=tiny_datamodule(6, 3))  # fmt: skip
        assert not stale.exists() and live.exists() and other_host.exists()  # a live writer's, or another machine's: kept
    finally:
        alive.kill()


CHECKPOINT_MEMORY = """
import resource, sys, torch
from fl_lightning.reliability.checkpoint_io import StreamingCheckpointIO
size_mb = 200
checkpoint = {"state_dict": {f"w{i}": torch.randn(1 << 18) for i in range(size_mb)}, "global_step": 3}
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = rss()
StreamingCheckpointIO().save_checkpoint(checkpoint, sys.argv[1])
print((rss() - before) / size_mb)
"""


def test_a_checkpoint_write_peaks_well_below_2x_its_size(tmp_path):
    """Lightning's default write serialized the whole checkpoint into a BytesIO first (measured: the write
    added 1.0x the checkpoint's size to the peak, benchmarks/checkpoint_memory.py); streamed, it adds ~0."""
    out = subprocess.run([sys.executable, "-c", CHECKPOINT_MEMORY, str(tmp_path / "c.ckpt")], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    extra = float(out.stdout.strip().splitlines()[-1])  # peak memory added by the write, in checkpoint sizes
    assert extra < 0.5, extra
    assert torch.load(tmp_path / "c.ckpt", weights_only=True)["global_step"] == 3


def test_a_stop_checkpoint_of_a_disk_store_run_resumes_in_its_folder(tmp_path):
    """The stop checkpoint names a snapshot of the store (kept, not rotated away) and resumes into the same folder."""
    common = ["--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
              "--model.algorithm", "fl_lightning.algorithms.SCAFFOLD", "--model.store", "fl_lightning.core.state.DiskClientStore",
              "--model.store.directory", str(tmp_path / "store"), "--model.store.keep_snapshots", "1"]  # fmt: skip
    stopped = _cli_line(tmp_path, "--trainer.max_steps", "4", *common, "--trainer.callbacks+", "tests.test_reliability.SigtermAfterRound2")
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert f"wrote the checkpoint of the 2 completed rounds: {last}" in stopped.stderr.strip().splitlines()[-1]
    resumed = _cli_line(tmp_path, "--trainer.max_steps", "4", *common, "--ckpt_path", str(last))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "(resumed at round 2)" in resumed.stdout, resumed.stdout[-2000:]


class SigtermDuringValidation(Callback):
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        trainer._signal_connector.received_sigterm = True


def test_a_stop_during_validate_only_writes_no_checkpoint(tmp_path):
    """Only a fit writes the stop checkpoint: `validate` must never overwrite a training run's last.ckpt."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = tiny_trainer(tmp_path, 1, enable_checkpointing=True, callbacks=[callback, SigtermDuringValidation()], limit_val_batches=1.0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8))
    with pytest.raises(SIGTERMException):
        trainer.validate(module, datamodule=tiny_datamodule(6, 3, eval_batch_size=10))
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


def test_the_sigint_handler_is_restored_after_fit(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    trainer = tiny_trainer(tmp_path, 1)
    trainer.fit(FederatedModule(MLP(8, 3, hidden=[16]), FedAvg(), LocalTraining(lr=0.1, steps=2, batch_size=8)),
                datamodule=tiny_datamodule(6, 3))  # fmt: skip
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_without_a_checkpoint_callback_says_why_none_was_written(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["fit", *QUICK[:2], "--trainer.max_steps", "4", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "tests.test_reliability.SigtermAfterRound2",
              "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
    assert stopped.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fl-lightning: error: round 2: stopped by SIGTERM before the round started; no checkpoint was written "
        "(no ModelCheckpoint callback); resume from the last checkpoint, if any"
    )
    assert not list(tmp_path.rglob("*.ckpt"))
