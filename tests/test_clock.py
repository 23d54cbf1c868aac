"""The simulated clock (docs/algorithms.md, 27): devices, availability, task times from the message
pipeline's bytes, synchronous rounds (the slowest client or a deadline), and the CLI."""

import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import FedAvg
from fl_lightning.clock import SimClock
from fl_lightning.clock.devices import on_off_windows
from fl_lightning.clock.sizes import nominal_upload_bytes
from fl_lightning.compression import TopK
from fl_lightning.compression.stages import Compression
from fl_lightning.core.participation import derive_seed
from models import LinearRegression
from tests import clock_reference as ref
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

ROOT = Path(__file__).resolve().parents[1]


def test_lognormal_devices_follow_the_stated_distribution():
    devices = SimClock(speed_sigma=0.7, bandwidth=5e5, bandwidth_sigma=0.3, seed=4).devices(2000)
    z = np.random.default_rng(derive_seed(4, 0xC10C)).standard_normal((2, 2000))
    assert np.array_equal(devices.speed, np.exp(0.7 * z[0])) and np.array_equal(devices.bandwidth, 5e5 * np.exp(0.3 * z[1]))
    assert abs(np.median(np.log(devices.speed))) < 0.05 and abs(np.std(np.log(devices.speed)) - 0.7) < 0.05


def test_trace_file_and_its_windows(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth,windows\n1,0.5,2000,10-20;30-40\n0,2,1000,0-100\n")
    clock = SimClock(trace=str(trace), availability="trace", period=100.0)
    devices = clock.devices(2)
    assert devices.speed.tolist() == [2.0, 0.5] and devices.bandwidth.tolist() == [1000.0, 2000.0]
    assert [devices.next_online(1, t) for t in (0.0, 15.0, 25.0, 45.0, 135.0)] == [10.0, 15.0, 30.0, 110.0, 135.0]
    assert clock.task_seconds(devices, 1, 4, 1000, 3000) == 4 * 0.1 / 0.5 + 4000 / 2000
    trace.write_text("client,speed,bandwidth,windows\n1,0.5,2000,10-20\n0,2,1000,\n")
    with pytest.raises(ValueError, match="client 0 has no online window"):
        SimClock(trace=str(trace), availability="trace").devices(2)
    trace.write_text("client,speed,bandwidth\n0,-1,1000\n")
    with pytest.raises(ValueError, match="line 2: speed and bandwidth must be finite and > 0"):
        SimClock(trace=str(trace)).devices(1)


def test_on_off_availability_against_a_scan():
    period, duty = 10.0, 0.3
    windows = on_off_windows(5, 0, period, duty)
    devices = SimClock(availability="on_off", period=period, duty=duty).devices(5)
    grid = np.arange(0, 40, 0.01)
    for c in range(5):
        online = [any(s <= t % period < e for s, e in windows[c]) for t in grid]
        assert abs(np.mean(online) - duty) < 0.01
        for t in (0.0, 3.3, 7.1, 12.5):
            first = next(g for g, on in zip(grid, online) if g >= t and on)
            assert abs(devices.next_online(c, t) - first) < 0.011


def test_nominal_upload_bytes_are_the_pipelines(tmp_path):
    """Compression shortens the clock's transfers by exactly the encoded size the pipeline reports."""
    module = tiny_module()
    module.compression = compression = Compression(up=TopK(ratio=0.1))
    x = module.global_params()
    dense, sparse = nominal_upload_bytes(FedAvg(), x), nominal_upload_bytes(FedAvg(), x, compression)
    assert sparse < dense / 3
    torch.manual_seed(0)
    from models import MLP

    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[16]), compression=compression, local=LocalTraining(steps=3, batch_size=8), clock=SimClock())
    tiny_trainer(tmp_path, 1, callbacks=[Grab()]).fit(module, datamodule=tiny_datamodule())
    assert module.trainer.callbacks[0].rows[0]["comm/round_bytes_up"] == 3 * sparse


class Grab(L.Callback):
    def __init__(self):
        self.rows, self.times = [], []

    def on_train_batch_end(self, trainer, module, *args):
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.times.append(module.sim_time)


# docs/algorithms.md, (27.4): synchronous FedAvg is FedBuff with the cohort as its buffer and no staleness
def test_synchronous_fedavg_is_the_reduction(tmp_path):
    x, y = ref.problem()
    torch.manual_seed(0)
    model = LinearRegression(ref.d).double()
    theta0 = torch.cat([model.linear.weight.detach().flatten(), model.linear.bias.detach()]).numpy().copy()
    clock = SimClock(step_cost=ref.STEP_COST, speed_sigma=1.0, bandwidth=ref.BANDWIDTH, bandwidth_sigma=0.5, seed=3)
    module = FederatedModule(model, FedAvg(), LocalTraining(lr=ref.LR, steps=ref.K, batch_size=None), clock=clock)
    grab = Grab()
    tiny_trainer(tmp_path, 5, callbacks=[grab]).fit(module, datamodule=ref.LeastSquaresData(x, y))
    expected = ref.simulate_sync(theta0, x.numpy(), y.numpy(), *ref.devices(3, 1.0, 0.5), 5)
    theta = torch.cat([module.model.linear.weight.detach().flatten(), module.model.linear.bias.detach()]).numpy()
    assert np.abs(theta - expected[-1][0]).max() < 1e-12
    assert np.allclose(grab.times, [t for _, t in expected], rtol=0, atol=1e-12)


def _deadline_run(tmp_path, action):
    module = tiny_module()
    module.clock = SimClock(speed_sigma=1.5, deadline=0.35, deadline_action=action)
    grab = Grab()
    tiny_trainer(tmp_path, 4, callbacks=[grab]).fit(module, datamodule=tiny_datamodule(num_clients=6, clients_per_round=6))
    return module, grab


@pytest.mark.parametrize("action", ["dropout", "straggler"])
def test_deadline_makes_late_clients_dropouts_or_stragglers(tmp_path, action):
    module, grab = _deadline_run(tmp_path, action)
    devices = module.clock.devices(6)
    bytes_ = 2 * sum(p.numel() * 4 for p in module.model.parameters())
    late = [c for c in range(6) if module.clock.task_seconds(devices, c, 3, bytes_ / 2, bytes_ / 2) > 0.35]
    assert 0 < len(late) < 6
    row = grab.rows[-1]
    missed = row["faults/deadline_dropped"] + row["faults/deadline_stragglers"]
    assert missed == len(late) and row["train/clients"] == 6 - row["faults/deadline_dropped"]
    assert (row["faults/deadline_stragglers"] > 0) == (action == "straggler")
    assert np.allclose(np.diff([0.0, *grab.times]), 0.35)  # every round ends at its deadline


def test_clock_off_changes_nothing(tmp_path):
    plain, timed = tiny_module(), tiny_module()
    timed.clock = SimClock(speed_sigma=1.0)
    tiny_trainer(tmp_path / "a", 3).fit(plain, datamodule=tiny_datamodule())
    tiny_trainer(tmp_path / "b", 3).fit(timed, datamodule=tiny_datamodule())
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), timed.parameters()))
    assert plain.sim_time == 0.0 and timed.sim_time > 0


@pytest.mark.parametrize("value,match", [("--model.clock.step_cost=-1", "clock.step_cost must be > 0"),
                                         ("--model.asynchronous.buffer_size=0", "asynchronous.buffer_size must be an integer >= 1")])  # fmt: skip
def test_bad_settings_are_one_line_with_exit_code_2(tmp_path, value, match):
    exe = Path(sys.executable).with_name("fl-lightning")
    run = subprocess.run([str(exe), "fit", "--config", str(ROOT / "configs" / "fedbuff_digits.yaml"), value], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 2 and match in run.stderr, run.stderr[-2000:]


def test_cli_fit_logs_simulated_time_and_compare_reports_time_to_target(tmp_path):
    """``fl-lightning fit --config configs/clock_digits.yaml``, then the comparison's table and figure use time/sim_s."""
    from fl_lightning.experiments.history import SIM_TIME, History
    from fl_lightning.experiments.plots import figures_for
    from fl_lightning.experiments.tables import summary_tables

    exe = Path(sys.executable).with_name("fl-lightning")
    args = [str(exe), "fit", "--config", str(ROOT / "configs" / "clock_digits.yaml"), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
            "--trainer.enable_progress_bar", "false", "--model.clock.deadline", "2.5", "--model.local.steps", "3"]  # fmt: skip
    run = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    history = History.from_csv(next(tmp_path.glob("runs/clock_digits/version_0/metrics.csv")))
    times = [r[SIM_TIME] for r in history.records if SIM_TIME in r and "train/loss" in r]  # the rounds' rows (evaluations repeat it)
    assert len(times) == 4 and all(b > a for a, b in zip(times, times[1:])) and max(np.diff([0.0, *times])) <= 2.5 + 1e-9
    tables = summary_tables({"sync": [history]}, [0], [0.0])
    row = next(r for r in tables[1].rows if r[0] == "Simulated time (s)")
    assert float(row[2].split()[0]) == pytest.approx(times[1], abs=0.05)  # reached at the first evaluation (round 2)
    assert "acc_vs_sim_time" in [f.name for f in figures_for({"sync": [history]})]


def test_synchronous_resume_keeps_the_clock(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(path, rounds, ckpt=None):
        module = tiny_module()
        module.clock = SimClock(speed_sigma=1.0, availability="on_off", period=2.0, duty=0.5)
        checkpoint = ModelCheckpoint(dirpath=path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        tiny_trainer(path, rounds, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, datamodule=tiny_datamodule(), ckpt_path=ckpt)
        return module

    straight = fit(tmp_path / "a", 4)
    fit(tmp_path / "b", 2)
    resumed = fit(tmp_path / "c", 4, str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert straight.sim_time == resumed.sim_time > 0
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
