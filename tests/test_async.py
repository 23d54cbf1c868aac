"""FedBuff and FedAsync under the simulated clock (docs/algorithms.md, 27): the trajectory equals an
independent float64 numpy event simulation; refusals; bitwise resume with clients in flight."""

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import SCAFFOLD, FedAdam, FedAvg, FedDyn, FedProx
from fl_lightning.clock import SimClock
from fl_lightning.clock.asynchronous import AsyncAggregation, defined_asynchronously
from fl_lightning.clock.events import EventQueue, InFlight
from fl_lightning.pipeline.privacy import ClientPrivacy
from models import LinearRegression
from tests import clock_reference as ref
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

UPDATES = 12


class Trajectory(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, *args):
        theta = torch.cat([module.model.linear.weight.detach().flatten(), module.model.linear.bias.detach()])
        self.rows.append((theta.numpy().copy(), module.sim_time))


def _fit(tmp_path, asynchronous, execution="sequential", updates=UPDATES):
    x, y = ref.problem()
    torch.manual_seed(0)
    model = LinearRegression(ref.d).double()
    theta0 = torch.cat([model.linear.weight.detach().flatten(), model.linear.bias.detach()]).numpy().copy()
    clock = SimClock(step_cost=ref.STEP_COST, speed_sigma=1.0, bandwidth=ref.BANDWIDTH, bandwidth_sigma=0.5, seed=3)
    module = FederatedModule(
        model, FedAvg(), LocalTraining(lr=ref.LR, steps=ref.K, batch_size=None), clock=clock, asynchronous=asynchronous, execution=execution
    )
    trajectory = Trajectory()
    tiny_trainer(tmp_path, updates, callbacks=[trajectory]).fit(module, datamodule=ref.LeastSquaresData(x, y))
    return theta0, x.numpy(), y.numpy(), trajectory.rows, module


# docs/algorithms.md, (27.5)-(27.8)
@pytest.mark.parametrize("mode,concurrency,buffer_size", [("fedbuff", 5, 3), ("fedasync", 4, 1)])
def test_trajectory_equals_numpy_event_simulation(tmp_path, mode, concurrency, buffer_size):
    config = AsyncAggregation(mode=mode, concurrency=concurrency, buffer_size=buffer_size, staleness="polynomial", exponent=0.5, alpha=0.6)
    theta0, x, y, rows, module = _fit(tmp_path, config)
    speed, bandwidth = ref.devices(3, 1.0, 0.5)
    expected = ref.simulate_async(theta0, x, y, speed, bandwidth, module.datamodule.seed, mode, concurrency, buffer_size, UPDATES)
    assert len(rows) == len(expected) == UPDATES
    theta_diff = max(float(np.abs(a - b).max()) for (a, _), (b, _) in zip(rows, expected))
    time_diff = max(abs(s - t) for (_, s), (_, t) in zip(rows, expected))
    print(f"{mode}: max |theta - numpy| = {theta_diff:.3g}, max |time - numpy| = {time_diff:.3g} s")
    assert theta_diff < 1e-12 and time_diff < 1e-9
    assert float(np.abs(rows[-1][0] - theta0).max()) > 0.1  # it trained
    assert rows[-1][1] > rows[0][1] > 0


def test_batched_equals_sequential_for_the_same_events(tmp_path):
    config = AsyncAggregation(concurrency=6, buffer_size=3)
    *_, sequential, _ = _fit(tmp_path / "s", config, updates=6)
    *_, batched, _ = _fit(tmp_path / "b", config, "batched", updates=6)
    for (a, s), (b, t) in zip(sequential, batched):
        assert s == t and np.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("algorithm", [SCAFFOLD(), FedDyn()], ids=["SCAFFOLD", "FedDyn"])
def test_algorithms_with_cohort_state_are_refused_in_one_line(algorithm):
    with pytest.raises(ValueError, match=f"not defined for {type(algorithm).__name__}") as error:
        FederatedModule(LinearRegression(3), algorithm, clock=SimClock(), asynchronous=AsyncAggregation())
    assert "\n" not in str(error.value)


def test_declared_algorithms():
    assert all(defined_asynchronously(a) for a in (FedAvg(), FedProx(), FedAdam()))
    assert not any(defined_asynchronously(a) for a in (SCAFFOLD(), FedDyn()))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clock=None), "needs model.clock"),
        (dict(privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0)), "model.privacy"),
        (dict(clock=SimClock(deadline=1.0)), "clock.deadline applies to synchronous"),
    ],
)
def test_refused_combinations(kwargs, match):
    kwargs = {"clock": SimClock(), **kwargs}
    with pytest.raises(ValueError, match=match):
        FederatedModule(LinearRegression(3), FedAvg(), asynchronous=AsyncAggregation(), **kwargs)


def test_concurrency_beyond_the_population_is_one_line(tmp_path):
    module = tiny_module()
    module.clock, module.asynchronous = SimClock(), AsyncAggregation(concurrency=6, buffer_size=2)
    with pytest.raises(ValueError, match="concurrency"):
        tiny_trainer(tmp_path, 2).fit(module, datamodule=tiny_datamodule(num_clients=6))


def _resumable(tmp_path, rounds, ckpt_path=None):
    torch.manual_seed(0)
    module = tiny_module(FedAdam(global_lr=0.05), LocalTraining(lr=0.1, steps=3, batch_size=8))
    module.clock = SimClock(speed_sigma=1.0, availability="on_off", period=5.0, duty=0.6)
    module.asynchronous = AsyncAggregation(concurrency=5, buffer_size=3, staleness="hinge", hinge_b=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=10), ckpt_path=ckpt_path)
    return module


def test_resume_with_clients_in_flight_is_bitwise(tmp_path):
    straight = _resumable(tmp_path / "a", 8)
    _resumable(tmp_path / "b", 4)  # concurrency - 1 clients in flight: the last arrival is replaced by the next update
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["federated"]["clock"]
    assert len(saved["events"]["in_flight"]) == 5 - 1 and saved["events"]["versions"] and saved["sim_time"] > 0
    resumed = _resumable(tmp_path / "c", 8, ckpt_path=str(last))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert straight.sim_time == resumed.sim_time
    assert straight._events.state_dict()["in_flight"] == resumed._events.state_dict()["in_flight"]
    assert straight.trainer.optimizers[0].state_dict()["state"].keys() == resumed.trainer.optimizers[0].state_dict()["state"].keys()


def test_versions_are_shared_by_the_clients_in_flight():
    """10^5 clients, 10^3 in flight from 10 versions: 10 copies of the model, not 10^3."""
    events, x = EventQueue(), {"w": torch.zeros(1000)}
    for i in range(1000):
        events.push(InFlight(float(i), 0.0, i, i * 100, i // 100, 1, 0.0), x)
    assert len(events.heap) == 1000 and len(events.versions) == 10
    for _ in range(950):
        events.pop()
    events.release()
    assert sorted(events.versions) == [9]


def test_uplink_compression_composes_and_shortens_time(tmp_path):
    from fl_lightning.compression import TopK
    from fl_lightning.compression.stages import Compression

    def fit(compression):
        torch.manual_seed(0)
        from models import MLP

        module = FederatedModule(
            MLP(in_features=8, num_classes=3, hidden=[16]), local=LocalTraining(lr=0.1, steps=3, batch_size=8), compression=compression,
            clock=SimClock(bandwidth=2e3), asynchronous=AsyncAggregation(concurrency=4, buffer_size=2),
        )  # fmt: skip
        tiny_trainer(tmp_path, 4).fit(module, datamodule=tiny_datamodule(num_clients=6))
        return module

    dense, sparse = fit(None), fit(Compression(up=TopK(ratio=0.1)))
    assert sparse.sim_time < 0.8 * dense.sim_time
    assert sparse.comm_totals["bytes_up"] < dense.comm_totals["bytes_up"] / 3
    assert not all(torch.equal(a, b) for a, b in zip(dense.parameters(), sparse.parameters()))


def test_resuming_an_asynchronous_checkpoint_synchronously_is_one_line(tmp_path):
    from fl_lightning.core.errors import CheckpointError

    _resumable(tmp_path / "b", 2)
    module = tiny_module(FedAdam(global_lr=0.05), LocalTraining(lr=0.1, steps=3, batch_size=8))
    with pytest.raises(CheckpointError, match="written with model.asynchronous"):
        tiny_trainer(tmp_path / "c", 4).fit(module, datamodule=tiny_datamodule(num_clients=10), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
