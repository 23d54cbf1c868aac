"""Client-level DP (DP-FedAvg) on the message pipeline: clipping, noise, fixed denominator,
executors, resume, refusals (docs/privacy.md; (DP.1) in fl_lightning/pipeline/privacy.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning import algorithms as A
from fl_lightning.algorithms.base import RoundInfo
from fl_lightning.pipeline.messages import COMPRESS, ClientStage, MessagePipeline, Sent, upload_like
from fl_lightning.core.participation import BernoulliParticipation, UniformSampling
from fl_lightning.pipeline.privacy import ClientPrivacy, GaussianSumNoise, clip
from fl_lightning.pipeline.privacy_accounting import SamplingScheme, epsilon_after
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

N, S = 8, 4
LOCAL = LocalTraining(lr=0.1, steps=3, batch_size=8)


def _module(algorithm=None, privacy=None, execution="sequential", uplink=None, seed=0):
    torch.manual_seed(seed)
    return FederatedModule(MLP(8, 3, hidden=[16]), algorithm or A.FedAvg(), LOCAL, execution=execution, privacy=privacy, uplink=uplink)


def _fit(tmp_path, module, rounds=2, data=None, **kw):
    trainer = tiny_trainer(tmp_path, rounds, **kw)
    trainer.fit(module, datamodule=data or tiny_datamodule(num_clients=N, clients_per_round=S))
    return trainer


def _bernoulli_data(probabilities):
    from datamodules import Dirichlet, FederatedDataModule

    return FederatedDataModule(
        dataset="synthetic", dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1},
        num_clients=N, partition=Dirichlet(0.5, min_size=5), participation=BernoulliParticipation(probabilities),
    )  # fmt: skip


def _params(module):
    return [p.detach().clone() for p in module.model.parameters()]


class Scaled(A.FedAvg):
    """FedAvg whose client 0 sends its update times ``factor`` (a client far outside the clip norm)."""

    upload_entries = ("delta",)
    elementwise = False

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def client_finish(self, params, local, ctx):
        upload, state = super().client_finish(params, local, ctx)
        scale = self.factor if ctx.client_id == 0 else 1.0
        return {"delta": {k: v * scale for k, v in upload["delta"].items()}}, state


class Recording(A.FedAvg):
    """FedAvg that keeps every upload it sends (the unclipped deltas, for a numpy reference)."""

    upload_entries = ("delta",)
    elementwise = False

    def __init__(self):
        super().__init__()
        self.sent = []

    def client_finish(self, params, local, ctx):
        upload, state = super().client_finish(params, local, ctx)
        self.sent.append({k: v.detach().double().numpy().copy() for k, v in upload["delta"].items()})
        return upload, state


# ---- (DP.1) at sigma = 0 -------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [A.FedAvg, A.SCAFFOLD])
def test_no_clipping_and_no_noise_is_plain_aggregation_bitwise(tmp_path, make):
    """C far above every update and sigma = 0: uniform sampling's weights 1/S are the fixed 1/D."""
    plain, private = _module(make()), _module(make(), ClientPrivacy(clip_norm=1e9, noise_multiplier=0.0))
    _fit(tmp_path / "a", plain, rounds=3)
    _fit(tmp_path / "b", private, rounds=3)
    for a, b in zip(plain.model.parameters(), private.model.parameters()):
        assert torch.equal(a, b)


def test_sigma_zero_is_clipped_fedavg_against_a_numpy_reference(tmp_path):
    clip_norm = 0.05
    algorithm = Recording()
    module = _module(algorithm, ClientPrivacy(clip_norm=clip_norm, noise_multiplier=0.0))
    x0 = {k: v.detach().double().numpy().copy() for k, v in module.global_params().items()}
    _fit(tmp_path, module, rounds=1)
    assert len(algorithm.sent) == S
    total = {k: np.zeros_like(v) for k, v in x0.items()}
    for delta in algorithm.sent:
        norm = math.sqrt(sum(float((v**2).sum()) for v in delta.values()))
        assert norm > clip_norm  # every client is clipped
        for k in total:
            total[k] += delta[k] * min(1.0, clip_norm / norm)
    for k, v in module.global_params().items():  # x1 = x0 + (1/D) sum_i clip(delta_i), D = S, global_lr = 1
        np.testing.assert_allclose(v.double().numpy(), x0[k] + total[k] / S, rtol=0, atol=1e-7)


def test_flat_and_per_entry_clipping_bound_the_norm():
    upload = {"delta": {"w": torch.full((3,), 4.0)}, "delta_c": {"w": torch.full((3,), 3.0)}}
    flat = clip(upload, 1.0)
    norm = math.sqrt(sum(float(v.square().sum()) for td in flat.values() for v in td.values()))
    assert norm == pytest.approx(1.0, rel=1e-6)
    assert torch.allclose(flat["delta"]["w"] / flat["delta_c"]["w"], torch.full((3,), 4 / 3))  # the direction is kept
    per = clip(upload, 1.0, per_entry=True)
    for td in per.values():
        assert float(td["w"].norm()) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    small = {"delta": {"w": torch.tensor([1e-3, -2e-3])}}
    assert torch.equal(clip(small, 1.0)["delta"]["w"], small["delta"]["w"])  # inside the ball: unchanged, bitwise


# ---- clipping holds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_a_huge_client_moves_the_aggregate_by_at_most_c_over_d(tmp_path, sigma):
    """Neighbouring runs: client 0's update times 1e6 vs times 0 (no contribution); the same seed draws the
    same noise, so the global models differ by at most C / D."""
    clip_norm, data = 0.05, lambda: tiny_datamodule(num_clients=N, clients_per_round=N)  # client 0 takes part
    huge = _module(Scaled(1e6), ClientPrivacy(clip_norm=clip_norm, noise_multiplier=sigma))
    absent = _module(Scaled(0.0), ClientPrivacy(clip_norm=clip_norm, noise_multiplier=sigma))
    _fit(tmp_path / "a", huge, rounds=1, data=data())
    _fit(tmp_path / "b", absent, rounds=1, data=data())
    pairs = zip(huge.model.parameters(), absent.model.parameters())
    gap = math.sqrt(sum(float((a.detach().double() - b.detach().double()).square().sum()) for a, b in pairs))
    assert 0.5 * clip_norm / N < gap <= clip_norm / N * (1 + 1e-5)


# ---- the noise ---------------------------------------------------------------------------------------------
def test_noise_variance_is_sigma_c_over_d_squared():
    """R seeded rounds of a fixed input through the server's sum (what the module computes): the
    per-coordinate variance of the aggregate is sigma^2 C^2 / D^2. With n = R * d samples the sample
    variance has relative standard error sqrt(2 / (n - 1)) = 1.1 %; we allow 5 standard errors."""
    sigma, clip_norm, num_clients, cohort = 1.5, 0.7, 100, 10
    privacy = ClientPrivacy(clip_norm=clip_norm, noise_multiplier=sigma)
    privacy.prepare(UniformSampling(cohort), num_clients, rounds=1)
    pipeline, algorithm = MessagePipeline(privacy.stages()), A.FedAvg()
    x = {"w": torch.zeros(200), "b": torch.zeros(100)}
    uploads = [clip({"delta": {"w": torch.full((200,), float(i)), "b": torch.ones(100)}}, clip_norm) for i in range(cohort)]
    rows, mean = [], None
    for r in range(50):
        info = RoundInfo(r, 0.1, num_clients)
        weight = pipeline.aggregate.weight(info)
        sums = algorithm.upload_sum(x, uploads, [weight] * cohort, info)
        noise = pipeline.extra_sum(algorithm, x, upload_like(algorithm, x), info, seed=7)
        mean = sums["delta"]
        rows.append(torch.cat([sums["delta"][k] + noise["delta"][k] - mean[k] for k in ("w", "b")]).double())
    samples = torch.stack(rows)  # [rounds, d]: the noise of each round and coordinate
    expected = (sigma * clip_norm / cohort) ** 2
    n = samples.numel()
    assert abs(float(samples.mean())) < 5 * math.sqrt(expected / n)
    assert float(samples.square().mean()) == pytest.approx(expected, rel=5 * math.sqrt(2 / (n - 1)))
    first = pipeline.extra_sum(algorithm, x, upload_like(algorithm, x), RoundInfo(3, 0.1, num_clients), seed=7)
    again = pipeline.extra_sum(algorithm, x, upload_like(algorithm, x), RoundInfo(3, 0.1, num_clients), seed=7)
    other = pipeline.extra_sum(algorithm, x, upload_like(algorithm, x), RoundInfo(4, 0.1, num_clients), seed=7)
    assert torch.equal(first["delta"]["w"], again["delta"]["w"])  # (seed, round) fixes the draw
    assert not torch.equal(first["delta"]["w"], other["delta"]["w"])


def test_scaffold_control_variate_increments_are_noised_too():
    privacy = ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0)
    privacy.prepare(UniformSampling(4), 8, rounds=1)
    algorithm, x = A.SCAFFOLD(), {"w": torch.zeros(50)}
    extra = MessagePipeline(privacy.stages()).extra_sum(algorithm, x, upload_like(algorithm, x), RoundInfo(0, 0.1, 8), seed=0)
    assert set(extra) == {"delta", "delta_c"}
    assert float(extra["delta_c"]["w"].std()) == pytest.approx(1.0 / 8, rel=0.3)  # z / N: c's update is (1/N) sum
    assert float(extra["delta"]["w"].std()) == pytest.approx(1.0 / 4, rel=0.3)  # z / D


# ---- executors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [A.FedAvg, A.SCAFFOLD])
def test_batched_equals_sequential_under_dp(tmp_path, make):
    privacy = dict(clip_norm=0.05, noise_multiplier=1.0)
    sequential = _module(make(), ClientPrivacy(**privacy))
    batched = _module(make(), ClientPrivacy(**privacy), execution="batched")
    _fit(tmp_path / "a", sequential, rounds=3)
    _fit(tmp_path / "b", batched, rounds=3)
    for a, b in zip(sequential.model.parameters(), batched.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- resume --------------------------------------------------------------------------------------------------
def _resumable(tmp_path, rounds, ckpt_path=None, adaptive=False, accountant="rdp"):
    privacy = ClientPrivacy(clip_norm=0.05, noise_multiplier=1.1, delta=1e-4, adaptive_clipping=adaptive, count_noise=1.0, accountant=accountant)
    module = _module(A.SCAFFOLD(), privacy)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    data = _bernoulli_data([0.3, 0.6] * (N // 2))
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.parametrize("adaptive", [False, True])
def test_resume_gives_the_same_model_and_epsilon_bitwise(tmp_path, adaptive):
    straight, t1 = _resumable(tmp_path / "a", 4, adaptive=adaptive)
    _resumable(tmp_path / "b", 2, adaptive=adaptive)
    resumed, t2 = _resumable(tmp_path / "c", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"), adaptive=adaptive)
    if adaptive:
        assert resumed.privacy.current_clip == straight.privacy.current_clip != 0.05
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert straight.store.equal(resumed.store)
    assert resumed.privacy.accountant.rounds == 4
    assert float(t1.callback_metrics["privacy/epsilon"]) == float(t2.callback_metrics["privacy/epsilon"]) > 0
    scheme = SamplingScheme.of(BernoulliParticipation([0.3, 0.6] * (N // 2)), N)
    # adaptive clipping's two queries (update, count) spend together what sigma = 1.1 alone would (Andrew et al., Thm 1)
    assert float(t1.callback_metrics["privacy/epsilon"]) == pytest.approx(epsilon_after(scheme, 1.1, 1e-4, 4), rel=1e-6)
    assert float(t1.callback_metrics["privacy/epsilon_min"]) < float(t1.callback_metrics["privacy/epsilon"])  # p = 0.3 vs 0.6


def test_pld_resume_reports_the_straight_runs_epsilons_bitwise(tmp_path):
    """The PLD epsilon after T rounds is the cached one-round distribution self-composed T times: a resumed
    run, whose accountant starts at the checkpoint's round, reports the straight run's floats."""
    straight, t1 = _resumable(tmp_path / "a", 4, accountant="pld")
    _resumable(tmp_path / "b", 2, accountant="pld")
    resumed, t2 = _resumable(tmp_path / "c", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"), accountant="pld")
    assert resumed.privacy.accountant.rounds == 4
    eps = straight.privacy.accountant.epsilons()  # float64 (the logged metrics are float32)
    assert np.array_equal(eps, resumed.privacy.accountant.epsilons()) and eps.min() < eps.max()
    for key in ("privacy/epsilon", "privacy/epsilon_min"):
        assert float(t1.callback_metrics[key]) == float(t2.callback_metrics[key]) > 0
    scheme = SamplingScheme.of(BernoulliParticipation([0.3, 0.6] * (N // 2)), N)
    assert eps.max() == pytest.approx(epsilon_after(scheme, 1.1, 1e-4, 4, "pld"), rel=1e-12) and eps.max() < epsilon_after(scheme, 1.1, 1e-4, 4)


# ---- budgets -----------------------------------------------------------------------------------------------
def test_target_epsilon_calibrates_sigma_before_training(tmp_path):
    privacy = ClientPrivacy(clip_norm=0.05, target_epsilon=20.0, delta=1e-4)
    trainer = _fit(tmp_path, _module(privacy=privacy), rounds=3, data=_bernoulli_data(0.5))
    assert privacy.noise_multiplier != 1.0
    assert float(trainer.callback_metrics["privacy/epsilon"]) <= 20.0


def test_target_epsilon_with_stop_ends_the_run_when_the_budget_is_spent(tmp_path):
    scheme = SamplingScheme.of(UniformSampling(S), N)
    budget = epsilon_after(scheme, 2.0, 1e-4, 3) * 1.0001  # three rounds fit, the fourth does not
    privacy = ClientPrivacy(clip_norm=0.05, noise_multiplier=2.0, target_epsilon=budget, budget="stop", delta=1e-4)
    trainer = _fit(tmp_path, _module(privacy=privacy), rounds=10)
    assert trainer.global_step == 3 and float(trainer.callback_metrics["privacy/epsilon"]) <= budget


# ---- refusals and bad settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: A.FAdamGT(tracking=0.5), "FAdamGT cannot run under client-level DP: its aggregate is not declared a weighted sum"),
        (lambda: A.ScaffoldP(warm_start=True), "ScaffoldP cannot run under client-level DP"),
        (lambda: A.FedProx(mu=0.1), None),
    ],
)
def test_algorithms_whose_guarantee_cannot_be_stated_are_refused_before_training(tmp_path, make, message):
    module = _module(make(), ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0))
    if message is None:
        _fit(tmp_path, module, rounds=1)
        return
    with pytest.raises(ValueError, match=message):
        _fit(tmp_path, module, rounds=1)
    assert module.trainer.global_step == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip_norm=0.0), "privacy.clip_norm must be > 0"),
        (dict(clip_norm=-1.0), "privacy.clip_norm must be > 0"),
        (dict(noise_multiplier=-0.1), "privacy.noise_multiplier must be >= 0"),
        (dict(delta=0.0), "privacy.delta must be in \\(0, 1\\)"),
        (dict(delta=1.0), "privacy.delta must be in \\(0, 1\\)"),
        (dict(target_epsilon=0.0), "privacy.target_epsilon must be > 0"),
        (dict(budget="spend"), "privacy.budget must be 'calibrate' or 'stop'"),
    ],
)
def test_bad_privacy_settings_are_rejected_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClientPrivacy(**kwargs)


def test_pld_with_sampling_without_replacement_is_one_line_before_training(tmp_path):
    """dp-accounting's PLD accountant has no rule for SampledWithoutReplacementDpEvent (it raised mid-setup)."""
    module = _module(privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0, accountant="pld"))
    with pytest.raises(ValueError, match=r"^privacy.accountant=pld cannot account UniformSampling .*; use accountant: rdp"):
        _fit(tmp_path, module, rounds=2)
    assert module.trainer.global_step == 0


def test_an_unreachable_target_stops_before_training(tmp_path):
    module = _module(privacy=ClientPrivacy(clip_norm=1.0, target_epsilon=1e-4, delta=1e-5))
    with pytest.raises(ValueError, match="privacy.target_epsilon=0.0001 cannot be reached in 50 rounds"):
        _fit(tmp_path, module, rounds=50)
    assert module.trainer.global_step == 0


# ---- the pipeline contract: per-client stage state and encoded bytes -----------------------------------------------
class Halving(ClientStage):
    """A toy compressor: sends half the upload, reports 1 byte per coordinate, keeps a per-client counter."""

    order, name = COMPRESS, "halving"

    def apply(self, upload, state, key):
        count = state.get("count", {"n": torch.zeros(())})["n"] + 1
        nbytes = sum(v.numel() for td in upload.values() for v in td.values())
        return Sent({n: {k: v / 2 for k, v in td.items()} for n, td in upload.items()}, {"count": {"n": count}}, nbytes)


def test_client_stage_state_lives_in_the_store_and_bytes_reach_the_metrics(tmp_path):
    module = _module(uplink=[Halving()])
    trainer = _fit(tmp_path, module, rounds=3, data=tiny_datamodule(num_clients=N, clients_per_round=N))
    stored = module.store.get(0, dict)
    assert float(stored["msg:halving:count"]["n"]) == 3  # one application per round the client took part in
    assert "msg:halving:count" not in module.client_state(0, module.global_params()).algorithm  # the algorithm never sees it
    coordinates = sum(p.numel() for p in module.model.parameters())
    assert float(trainer.callback_metrics["comm/round_bytes_up"]) == N * coordinates


# ---- DDP ----------------------------------------------------------------------------------------------------------
def test_ddp_equals_one_process_under_dp(tmp_path):
    """Two DDP processes (gloo): each clips its own clients, the partial sums are all-reduced, every rank
    adds the same noise from (seed, round): the one-process model to float tolerance, the same epsilon."""
    from tests.test_distributed import _assert_close, _train

    single = _train(tmp_path, 1, "scaffold", False, "--privacy", "0.05", "1.0")
    ddp = _train(tmp_path, 2, "scaffold", False, "--privacy", "0.05", "1.0")
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert ddp["exchanges"] == {"gathered": 0, "summed": 3}
    assert single["metrics"]["privacy/epsilon"] == ddp["metrics"]["privacy/epsilon"] > 0
    assert single["metrics"]["comm/round_bytes_up"] == ddp["metrics"]["comm/round_bytes_up"]


def test_ddp_equals_one_process_under_adaptive_clipping(tmp_path):
    """The unclipped count is summed across the processes: the same C_t, model and epsilon as one process."""
    from tests.test_distributed import _assert_close, _train

    # C = 10 leaves every update unclipped: the count is the whole cohort, not one process's share
    single = _train(tmp_path, 1, "fedavg", False, "--privacy", "10", "1.0", "--adaptive-clipping")
    ddp = _train(tmp_path, 2, "fedavg", False, "--privacy", "10", "1.0", "--adaptive-clipping")
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert single["metrics"]["privacy/clip_norm"] == ddp["metrics"]["privacy/clip_norm"] != 10  # C moved, identically
    assert single["metrics"]["privacy/epsilon"] == ddp["metrics"]["privacy/epsilon"] > 0


def _halving_run(tmp_path, rounds, ckpt_path=None, store_dir="store"):
    from fl_lightning.core.state import DiskClientStore

    torch.manual_seed(0)
    store = DiskClientStore(str(tmp_path / store_dir))
    module = FederatedModule(MLP(8, 3, hidden=[16]), A.SCAFFOLD(), LOCAL, uplink=[Halving()], store=store)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S), ckpt_path=ckpt_path)
    module.store_state = module.store.state_dict()
    module.store.close()  # the next run in this process takes the folder over
    return module


def test_client_stage_state_survives_disk_store_and_resume_bitwise(tmp_path):
    straight = _halving_run(tmp_path / "a", 4)
    _halving_run(tmp_path / "b", 2)
    resumed = _halving_run(tmp_path / "b", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    a, b = straight.store_state, resumed.store_state
    assert a.keys() == b.keys() and any(":halving:" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---- adaptive clipping (Andrew et al. 2021) ------------------------------------------------------------------
def test_adaptive_clip_follows_the_geometric_rule_on_a_hand_worked_round():
    """30 of D = 50 clients unclipped, gamma = 0.5, eta_C = 0.2, count noise ~0: C_1 = C_0 exp(-0.2 (0.6 - 0.5))."""
    privacy = ClientPrivacy(clip_norm=2.0, noise_multiplier=1e9, adaptive_clipping=True, target_quantile=0.5, clip_lr=0.2, count_noise=1e-8)
    privacy.prepare(UniformSampling(50), 200, rounds=1)
    assert privacy.next_clip(30, RoundInfo(0, 0.1, 200)) == pytest.approx(2.0 * math.exp(-0.02), rel=1e-9)
    assert privacy.next_clip(50, RoundInfo(0, 0.1, 200)) < 2.0 < privacy.next_clip(0, RoundInfo(0, 0.1, 200))


def test_adaptive_clipping_moves_c_towards_the_quantile_and_splits_the_noise(tmp_path):
    privacy = ClientPrivacy(clip_norm=10.0, noise_multiplier=1.0, adaptive_clipping=True, target_quantile=0.5, clip_lr=0.5, count_noise=2.0)
    trainer = _fit(tmp_path, _module(privacy=privacy), rounds=4, data=tiny_datamodule(num_clients=N, clients_per_round=N))
    assert privacy.current_clip < 10.0 * math.exp(-0.5 * 0.5 * 3)  # every update is far below C = 10: C shrinks each round
    assert privacy.update_noise == pytest.approx((1.0 - (2 * 2.0) ** -2) ** -0.5)
    expected = epsilon_after(SamplingScheme.of(UniformSampling(N), N), 1.0, 1e-5, 4)
    assert float(trainer.callback_metrics["privacy/epsilon"]) == pytest.approx(expected, rel=1e-6)


def test_adaptive_clipping_refuses_a_count_noise_that_spends_the_budget(tmp_path):
    module = _module(privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=0.5, adaptive_clipping=True, count_noise=0.5))
    with pytest.raises(ValueError, match="privacy.count_noise=0.5 must exceed 1 / \\(2 noise_multiplier\\) = 1"):
        _fit(tmp_path, module, rounds=1)


def test_compare_plots_accuracy_against_epsilon():
    from fl_lightning.experiments.history import History
    from fl_lightning.experiments.plots import curves, figures_for

    records = [{"round": float(r), "privacy/epsilon": 0.5 * (r + 1), "val/acc": 0.1 * r} for r in range(4)]
    histories = {"DP": [History(records)]}
    figure = next(f for f in figures_for(histories) if f.name == "acc_vs_epsilon")
    assert figure.x == "privacy/epsilon" and figure.metric == "val/acc"
    assert list(curves(histories, figure)["DP"]["x"]) == [0.5, 1.0, 1.5, 2.0]


def test_resuming_with_a_different_noise_multiplier_is_refused(tmp_path):
    _resumable(tmp_path / "b", 2)
    module = _module(A.SCAFFOLD(), ClientPrivacy(clip_norm=0.05, noise_multiplier=2.0, delta=1e-4))
    trainer = tiny_trainer(tmp_path / "c", 4, enable_checkpointing=True)
    with pytest.raises(ValueError, match="privacy.noise_multiplier=2 differs from the checkpoint's 1.1"):
        trainer.fit(module, datamodule=_bernoulli_data([0.3, 0.6] * (N // 2)), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
