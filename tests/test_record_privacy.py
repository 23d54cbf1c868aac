"""Record-level DP-SGD in local training (Abadi et al., CCS 2016): the step (RDP.1) against a plain-PyTorch
loop over examples, the noise's scale, clipping, the sampling, the accounting (RDP.2) against independent
computations, executors, resume and refusals (docs/privacy.md, "Record-level DP-SGD")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning import algorithms as A
from fl_lightning.executors.dpsgd import NOISE_STREAM, NoiseSource, PrivateStep, RecordSampler, private_grad_fn
from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.core.objective import Objective
from fl_lightning.core.participation import derive_seed
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.pipeline.record_accounting import RecordAccountant
from fl_lightning.pipeline.record_privacy import RecordPrivacy
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.test_privacy_accounting import ORDERS, _epsilon, _independent_epsilon, _rdp_without_replacement, dp_accounting_rdp, poisson_reference

N, S = 8, 4
LOCAL = LocalTraining(lr=0.1, steps=3, batch_size=6)


def _module(algorithm=None, record=None, execution="sequential", privacy=None, local=LOCAL, model=None, **kw):
    torch.manual_seed(0)
    model = model if model is not None else MLP(8, 3, hidden=[16])
    return FederatedModule(model, algorithm or A.FedAvg(), local, execution=execution, record_privacy=record, privacy=privacy, **kw)


def _fit(tmp_path, module, rounds=3, data=None, **kw):
    trainer = tiny_trainer(tmp_path, rounds, **kw)
    trainer.fit(module, datamodule=data or tiny_datamodule(num_clients=N, clients_per_round=S))
    return trainer


# ---- (RDP.1): one step against a loop over examples with loss.backward() ----------------------------------------
def _reference_step(model, x, y, clip, sigma, seed, denominator):
    """Per example: backward, flatten, clip to C, sum; plus the noise drawn as the client's noise stream draws it."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for j in range(len(y)):
        model.zero_grad()
        F.cross_entropy(model(x[j : j + 1]), y[j : j + 1]).backward()
        grads = [p.grad.double() for p in model.parameters()]
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        factor = min(1.0, clip / float(norm))
        total = [t + factor * g for t, g in zip(total, grads)]
    generator = torch.Generator().manual_seed(derive_seed(seed, NOISE_STREAM))
    noise = [torch.randn(p.shape, generator=generator, dtype=torch.float64) * sigma * clip for p in model.parameters()]
    return [(t + z) / denominator for t, z in zip(total, noise)]


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_step_equals_a_loop_over_examples_with_backward(sigma):
    torch.manual_seed(1)
    model = MLP(8, 3, hidden=[16])
    names = [n for n, _ in model.named_parameters()]
    x, y = torch.randn(7, 8) * 3, torch.randint(0, 3, (7,))
    x[6] = 1e3  # a padding row (masked out): must not count
    mask = torch.tensor([1.0] * 6 + [0.0])
    clip, seed, denominator = 0.3, 1234, 5.0  # C below most per-example norms: clipping is active
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = PrivateStep((x, y), mask, torch.tensor(6))
    value, ours = private_grad_fn(Objective(model, names), step, [NoiseSource(seed, sigma * clip)], torch.tensor(denominator), clip, 0.0)(params)
    reference = _reference_step(model, x[:6], y[:6], clip, sigma, seed, denominator)
    for name, ref in zip(names, reference):
        torch.testing.assert_close(ours[name].double(), ref, rtol=1e-5, atol=1e-7)
    assert float(value) == pytest.approx(float(F.cross_entropy(model(x[:6]), y[:6]).detach()), rel=1e-5)


def test_a_second_gradient_in_one_step_is_refused():
    model = MLP(8, 3, hidden=[16])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = PrivateStep((torch.randn(4, 8), torch.randint(0, 3, (4,))), torch.ones(4), torch.tensor(4))
    grad = private_grad_fn(Objective(model, list(params)), step, [NoiseSource(0, 1.0)], torch.tensor(4.0), 1.0, 0.0, name="Twice")
    grad(params)
    with pytest.raises(ValueError, match="record_privacy: Twice evaluates ctx.grad more than once per local step"):
        grad(params)


def test_noise_has_variance_sigma_c_over_b_squared():
    """g(sigma) - g(0) on the same records is z / B; over 400 seeds x 99 coordinates (39,600 draws) the sample
    variance's relative standard error is sqrt(2/39,599) = 0.7 %: a 4 % tolerance is over 5 standard errors."""
    torch.manual_seed(2)
    model = MLP(8, 3, hidden=[8])
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    objective = Objective(model, names)
    step = PrivateStep((torch.randn(5, 8), torch.randint(0, 3, (5,))), torch.ones(5), torch.tensor(5))
    clip, sigma, batch = 0.7, 1.5, 5.0
    clean = private_grad_fn(objective, step, [NoiseSource(0, 0.0)], torch.tensor(batch), clip, 0.0)(params)[1]
    diffs = []
    for seed in range(400):
        noisy = private_grad_fn(objective, step, [NoiseSource(seed, sigma * clip)], torch.tensor(batch), clip, 0.0)(params)[1]
        diffs.append(torch.cat([(noisy[n] - clean[n]).flatten() for n in names]).double())
    diffs = torch.stack(diffs)
    expected = (sigma * clip / batch) ** 2
    assert float(diffs.var()) == pytest.approx(expected, rel=0.04)
    assert abs(float(diffs.mean())) < 5 * (expected / diffs.numel()) ** 0.5  # mean 0, within 5 standard errors


def test_one_huge_example_moves_the_step_by_at_most_c_over_b():
    """Adding one example whose gradient is ~1e6 times the others' moves g by its clipped gradient / B: norm <= C/B
    (and = C/B: it is clipped), with the noise the same draw in both."""
    torch.manual_seed(3)
    model = MLP(8, 3, hidden=[16])
    names = [n for n, _ in model.named_parameters()]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    x[5] = x[5] * 1e6
    y[5] = model(x[5:6]).argmin()  # the least likely class: a gradient ~1e6 times the others'
    norms = []
    for j in (0, 5):
        model.zero_grad()
        F.cross_entropy(model(x[j : j + 1]), y[j : j + 1]).backward()
        norms.append(float(torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))))
    assert norms[1] > 1e5 * norms[0]
    clip, batch = 0.5, 6.0
    grads = []
    for mask in (torch.ones(6), torch.tensor([1.0] * 5 + [0.0])):
        step = PrivateStep((x, y), mask, mask.sum())
        grads.append(private_grad_fn(Objective(model, names), step, [NoiseSource(7, 2.0 * clip)], torch.tensor(batch), clip, 0.0)(params)[1])
    moved = torch.sqrt(sum((grads[0][n].double() - grads[1][n].double()).square().sum() for n in names))
    assert float(moved) <= clip / batch * (1 + 1e-5)
    assert float(moved) == pytest.approx(clip / batch, rel=1e-4)


# ---- a client's whole local training against a reference loop ------------------------------------------------------
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_a_clients_local_training_equals_a_reference_loop(sampling):
    """One FedAvg client, K = 4 steps, through the sequential executor: the records drawn as stated (Poisson:
    record j iff its uniform < q; fixed: the first B of a permutation), each step (RDP.1) by the per-example
    backward loop, then w <- w - lr g. The upload equals the reference's w_K - w_0."""
    from fl_lightning.algorithms.base import RoundInfo
    from fl_lightning.executors.dpsgd import SAMPLE_STREAM
    from fl_lightning.executors.base import ClientRuntime
    from fl_lightning.executors.sequential import run_task
    from fl_lightning.core.tasks import ClientState, ClientTask

    data = tiny_datamodule(num_clients=N, clients_per_round=S)
    data.setup("fit")
    local = LocalTraining(lr=0.3, steps=4, batch_size=5)
    record = RecordPrivacy(clip_norm=0.4, noise_multiplier=0.8, sampling=sampling)
    record.prepare(data, local)
    torch.manual_seed(4)
    model = MLP(8, 3, hidden=[16])
    names = [n for n, _ in model.named_parameters()]
    x0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    client, seed = 3, 987654321
    runtime = ClientRuntime(A.FedAvg(), Objective(model, names), data, local, torch.device("cpu"), record_privacy=record)
    task = ClientTask(client, seed, 4, {"x": x0}, lambda: ClientState({}, {}))
    result = run_task(task, RoundInfo(0, local.lr, N), runtime)

    records = data.client_full_batch(client)
    n = len(records[1])
    sampler = torch.Generator().manual_seed(derive_seed(seed, SAMPLE_STREAM))
    noise = torch.Generator().manual_seed(derive_seed(seed, NOISE_STREAM))
    reference = [p.detach().clone().double() for p in model.parameters()]
    for _ in range(4):
        if sampling == "poisson":
            chosen = torch.nonzero(torch.rand(n, generator=sampler, dtype=torch.float64) < 5 / n).flatten()
        else:
            chosen = torch.randperm(n, generator=sampler)[:5]
        with torch.no_grad():
            for p, w in zip(model.parameters(), reference):
                p.copy_(w)
        total = [torch.zeros_like(w) for w in reference]
        for j in chosen.tolist():
            model.zero_grad()
            F.cross_entropy(model(records[0][j : j + 1]), records[1][j : j + 1]).backward()
            grads = [p.grad.double() for p in model.parameters()]
            factor = min(1.0, 0.4 / float(torch.sqrt(sum(g.square().sum() for g in grads))))
            total = [a + factor * g for a, g in zip(total, grads)]
        z = [torch.randn(w.shape, generator=noise, dtype=torch.float64) * 0.8 * 0.4 for w in reference]
        reference = [w - 0.3 * (a + e) / 5 for w, a, e in zip(reference, total, z)]
    for name, w, w0 in zip(names, reference, x0.values()):
        torch.testing.assert_close(result.upload["delta"][name].double(), w - w0.double(), rtol=1e-4, atol=1e-6)


def test_an_empty_poisson_draw_is_noise_only_and_draws_pad_to_the_largest():
    """A step whose draw is empty (one masked row) gives z / B exactly; stacked draws pad to the largest draw."""
    from fl_lightning.executors.dpsgd import padded

    positions, mask, counts = padded([torch.tensor([4, 1]), torch.tensor([], dtype=torch.int64), torch.tensor([0, 2, 3])])
    assert positions.tolist() == [[4, 1, 0], [0, 0, 0], [0, 2, 3]] and mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert counts.tolist() == [2, 0, 3] and padded([torch.tensor([], dtype=torch.int64)])[0].shape == (1, 1)
    model = MLP(8, 3, hidden=[8])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = PrivateStep((torch.randn(1, 8), torch.randint(0, 3, (1,))), torch.zeros(1), torch.tensor(0))
    value, g = private_grad_fn(Objective(model, list(params)), step, [NoiseSource(3, 2.0)], torch.tensor(4.0), 1.0, 0.0)(params)
    generator = torch.Generator().manual_seed(derive_seed(3, NOISE_STREAM))
    for name, v in params.items():
        torch.testing.assert_close(g[name].double(), (torch.randn(v.shape, generator=generator, dtype=torch.float64) * 2.0 / 4).float().double())
    assert float(value) == 0.0


# ---- sampling ------------------------------------------------------------------------------------------------
def test_poisson_sampling_includes_each_record_with_probability_q():
    """4000 steps: each record's inclusion frequency within 5 binomial standard errors (sqrt(q(1-q)/4000) = 0.0063)
    of q; batch sizes vary with mean n q."""
    n, q, steps = 40, 0.2, 4000
    sampler = RecordSampler(n, q, 8, "poisson", seed=11)
    counts, sizes = torch.zeros(n), []
    for _ in range(steps):
        drawn = sampler.draw()
        assert len(set(drawn.tolist())) == len(drawn)  # no record twice
        counts[drawn] += 1
        sizes.append(len(drawn))
    tolerance = 5 * (q * (1 - q) / steps) ** 0.5
    assert float((counts / steps - q).abs().max()) < tolerance
    assert np.mean(sizes) == pytest.approx(n * q, abs=5 * (n * q * (1 - q) / steps) ** 0.5)
    assert min(sizes) < n * q < max(sizes)


def test_fixed_size_sampling_draws_b_distinct_records_uniformly():
    n, b, steps = 30, 6, 3000
    sampler = RecordSampler(n, b / n, b, "fixed", seed=5)
    counts = torch.zeros(n)
    for _ in range(steps):
        drawn = sampler.draw()
        assert len(drawn) == b and len(set(drawn.tolist())) == b
        counts[drawn] += 1
    q = b / n
    assert float((counts / steps - q).abs().max()) < 5 * (q * (1 - q) / steps) ** 0.5


# ---- accounting (RDP.2) against independent computations -------------------------------------------------------
@pytest.mark.parametrize("q, sigma, steps, delta", [(0.05, 1.0, 300, 1e-5), (0.2, 1.5, 60, 1e-4)])
def test_poisson_rdp_epsilon_matches_a_numpy_rdp(q, sigma, steps, delta):
    """At most dp-accounting's RdpAccountant at its default orders (its fractional orders' series over-states them);
    equal to an independent RDP (tests/test_privacy_accounting.py: binomial expansion and quadrature); within 1 %
    above the exact RDP's epsilon at that file's orders."""
    import dp_accounting

    accountant = RecordAccountant([100], [q], 0, sigma, delta, "poisson", "rdp")
    accountant.add([0], [steps])
    ours = accountant.epsilons()[0]
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    assert ours <= dp_accounting_rdp(event, steps, delta) * (1 + 1e-9)
    assert ours == pytest.approx(_independent_epsilon(q, sigma, steps, delta), rel=1e-6)
    exact = poisson_reference(q, sigma, steps, delta)
    assert exact * (1 - 1e-6) <= ours <= exact * 1.01


@pytest.mark.parametrize("q, sigma, steps, delta", [(0.05, 1.0, 300, 1e-5), (0.2, 1.5, 60, 1e-4)])
def test_poisson_pld_epsilon_matches_prv_accountant(q, sigma, steps, delta):
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant

    accountant = RecordAccountant([100], [q], 0, sigma, delta, "poisson", "pld")
    accountant.add([0], [steps])
    prv = PRVAccountant(PoissonSubsampledGaussianMechanism(q, sigma), eps_error=0.01, delta_error=1e-10, max_self_compositions=steps)
    low, reference, _ = prv.compute_epsilon(delta=delta, num_self_compositions=steps)
    assert accountant.epsilons()[0] == pytest.approx(reference, rel=0.01)
    rdp = RecordAccountant([100], [q], 0, sigma, delta, "poisson", "rdp")
    rdp.add([0], [steps])
    assert rdp.epsilons()[0] >= max(low, accountant.epsilons()[0])  # RDP stays an upper bound of the tighter methods


@pytest.mark.parametrize("n, b, sigma, steps, delta", [(200, 20, 1.5, 100, 1e-5), (50, 5, 3.0, 200, 1e-5)])
def test_fixed_size_epsilon_matches_a_numpy_rdp_without_replacement(n, b, sigma, steps, delta):
    """Replace-one adjacency: sensitivity 2C, so the Gaussian has noise multiplier sigma / 2 (Wang et al. 2019, Thm 9)."""
    accountant = RecordAccountant([n], [b / n], b, sigma, delta, "fixed", "rdp")
    accountant.add([0], [steps])
    reference = _epsilon(np.array([_rdp_without_replacement(b / n, sigma / 2, a) for a in ORDERS]) * steps, delta)
    assert accountant.epsilons()[0] == pytest.approx(reference, rel=0.01)


def test_each_client_composes_its_own_steps_and_the_worst_is_reported():
    sizes, batch = np.array([20, 40, 80, 40]), 4
    accountant = RecordAccountant(sizes, batch / sizes, batch, 1.2, 1e-5, "poisson", "rdp")
    accountant.add([0, 1, 2], [10, 10, 10])
    accountant.add([1, 2], [5, 5])
    eps = accountant.epsilons()
    for i, steps in enumerate([10, 15, 15, 0]):
        q = batch / sizes[i]
        reference = poisson_reference(q, 1.2, steps, 1e-5) if steps else 0.0
        assert eps[i] == pytest.approx(reference, rel=0.01)
    assert accountant.metrics()["privacy/record_epsilon"] == eps.max() == eps[0]  # the smallest client (largest q) spends most
    assert accountant.metrics()["privacy/record_epsilon_min"] == 0.0


class CountingFedAvg(A.FedAvg):
    """FedAvg counting its local steps per client (a rewritten client_step declares record_level_dp itself)."""

    record_level_dp = True
    elementwise = False

    def __init__(self):
        super().__init__()
        self.steps = np.zeros(N, dtype=np.int64)

    def client_step(self, params, local, ctx):
        self.steps[ctx.client_id] += 1
        return super().client_step(params, local, ctx)


@pytest.mark.parametrize("straggler", [0.0, 1.0])
def test_the_accountant_counts_the_steps_each_client_ran(tmp_path, straggler):
    algorithm = CountingFedAvg()
    record = RecordPrivacy(clip_norm=0.5, noise_multiplier=1.1, delta=1e-4)
    module = _module(algorithm, record, faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3))
    trainer = _fit(tmp_path, module, rounds=4)
    assert np.array_equal(record.accountant.steps, algorithm.steps)
    assert (algorithm.steps.sum() < 4 * S * 3) == (straggler > 0)  # stragglers ran fewer steps: counted as run
    sizes = np.asarray(trainer.datamodule.client_sizes)
    expected = max(poisson_reference(6 / sizes[i], 1.1, t, 1e-4) for i, t in enumerate(algorithm.steps) if t)
    assert float(trainer.callback_metrics["privacy/record_epsilon"]) == pytest.approx(expected, rel=0.01)


# ---- executors, composition, resume ---------------------------------------------------------------------------
@pytest.mark.parametrize("make, sampling", [(A.FedAvg, "poisson"), (A.SCAFFOLD, "fixed"), (lambda: A.MOON(mu=1.0), "poisson")])
def test_batched_equals_sequential(tmp_path, make, sampling):
    record = dict(clip_norm=0.3, noise_multiplier=1.0, sampling=sampling)
    sequential = _module(make(), RecordPrivacy(**record))
    batched = _module(make(), RecordPrivacy(**record), execution="batched")
    t1, t2 = _fit(tmp_path / "a", sequential), _fit(tmp_path / "b", batched)
    assert not batched.executor.inner.fallbacks  # it ran stacked (nested vmap), not sequentially
    for a, b in zip(sequential.model.parameters(), batched.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(t1.callback_metrics["privacy/record_epsilon"]) == float(t2.callback_metrics["privacy/record_epsilon"]) > 0


@pytest.mark.parametrize("local, straggler", [(LocalTraining(lr=0.1, steps=None, epochs=1, batch_size=6), 0.0), (LOCAL, 0.5)], ids=["epochs", "stragglers"])
def test_batched_equals_sequential_with_unequal_steps(tmp_path, local, straggler):
    """Clients of unequal K_i (local epochs over clients of different sizes; stragglers) stack: each client's draws and
    noise as sequential execution draws them, its padded steps masked; the accountant counts each client's own K_i."""
    record = dict(clip_norm=0.3, noise_multiplier=1.0)
    faults = dict(faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3))
    sequential = _module(A.SCAFFOLD(), RecordPrivacy(**record), local=local, **faults)
    batched = _module(A.SCAFFOLD(), RecordPrivacy(**record), execution="batched", local=local, **faults)
    t1, t2 = _fit(tmp_path / "a", sequential), _fit(tmp_path / "b", batched)
    stats = batched.executor.stats
    assert not batched.executor.inner.fallbacks and stats["stacked_rounds"] == 3 and stats["padded_work"] > 0
    for a, b in zip(sequential.model.parameters(), batched.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert np.array_equal(sequential.record_privacy.accountant.steps, batched.record_privacy.accountant.steps)
    assert float(t1.callback_metrics["privacy/record_epsilon"]) == float(t2.callback_metrics["privacy/record_epsilon"]) > 0
    assert float(t1.callback_metrics["train/loss"]) == pytest.approx(float(t2.callback_metrics["train/loss"]), rel=1e-5)


def test_composes_with_client_level_privacy_and_compression(tmp_path):
    from fl_lightning.compression import QSGD, Compression, TopK

    record = RecordPrivacy(clip_norm=0.3, noise_multiplier=1.0)
    privacy = ClientPrivacy(clip_norm=0.05, noise_multiplier=1.0, delta=1e-4)
    module = _module(A.FedAvg(), record, privacy=privacy, compression=Compression(up=TopK(ratio=0.3), down=QSGD(levels=4), error_feedback_up=False))
    trainer = _fit(tmp_path, module)
    assert float(trainer.callback_metrics["privacy/record_epsilon"]) > 0 and float(trainer.callback_metrics["privacy/epsilon"]) > 0


def test_sigma_zero_with_a_huge_clip_is_minibatch_sgd_on_the_drawn_records(tmp_path):
    """C = 1e9, sigma = 0, fixed-size batches: (RDP.1) is the mean gradient of the drawn batch; training moves
    the model and the epsilon is infinite (no noise)."""
    module = _module(A.FedAvg(), RecordPrivacy(clip_norm=1e9, noise_multiplier=0.0, sampling="fixed"))
    before = [p.detach().clone() for p in module.model.parameters()]
    trainer = _fit(tmp_path, module, rounds=2)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert float(trainer.callback_metrics["privacy/record_epsilon"]) == float("inf")


def test_compiled_execution_runs_eagerly_for_a_declared_reason(tmp_path):
    from fl_lightning.executors import SequentialExecutor

    record = dict(clip_norm=0.3, noise_multiplier=1.0)
    eager = _module(A.FedAvg(), RecordPrivacy(**record))
    compiled = _module(A.FedAvg(), RecordPrivacy(**record), execution=SequentialExecutor(compile=True, backend="aot_eager"))
    _fit(tmp_path / "a", eager), _fit(tmp_path / "b", compiled)
    assert list(compiled.executor.inner.fallbacks) == [
        "record-level DP-SGD (record_privacy) draws variable batches and per-example gradients, not compiled yet"
    ]
    for a, b in zip(eager.model.parameters(), compiled.model.parameters()):
        assert torch.equal(a, b)


def _resumable(tmp_path, rounds, ckpt_path=None):
    module = _module(A.SCAFFOLD(), RecordPrivacy(clip_norm=0.3, noise_multiplier=1.1, delta=1e-4))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_gives_the_same_model_and_epsilon_bitwise(tmp_path):
    straight, t1 = _resumable(tmp_path / "a", 4)
    _resumable(tmp_path / "b", 2)
    resumed, t2 = _resumable(tmp_path / "c", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert np.array_equal(straight.record_privacy.accountant.steps, resumed.record_privacy.accountant.steps)
    for key in ("privacy/record_epsilon", "privacy/record_epsilon_median"):
        assert float(t1.callback_metrics[key]) == float(t2.callback_metrics[key]) > 0


def test_resuming_with_a_different_noise_multiplier_is_refused(tmp_path):
    _resumable(tmp_path / "b", 1)
    module = _module(A.SCAFFOLD(), RecordPrivacy(clip_norm=0.3, noise_multiplier=2.0, delta=1e-4))
    with pytest.raises(ValueError, match="record_privacy.noise_multiplier=2 differs from the checkpoint's 1.1"):
        tiny_trainer(tmp_path / "c", 3).fit(
            module, datamodule=tiny_datamodule(num_clients=N, clients_per_round=S), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt")
        )


# ---- refusals and bad settings ----------------------------------------------------------------------------------
class BatchNormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize(
    "make, model, message",
    [
        (lambda: A.FedDecorr(beta=0.1), None, "record_privacy: FedDecorr does not declare record_level_dp"),
        (lambda: A.FedSAM(rho=0.05), None, "record_privacy: FedSAM does not declare record_level_dp"),
        (lambda: A.FedLC(tau=1.0), None, "record_privacy: FedLC does not declare record_level_dp"),
        (A.FedAvg, BatchNormMLP, "record_privacy: BatchNormMLP has BatchNorm"),
    ],
)
def test_what_has_no_stated_guarantee_is_refused_before_training(tmp_path, make, model, message):
    module = _module(make(), RecordPrivacy(), model=model() if model else None)
    with pytest.raises(ValueError, match=message):
        _fit(tmp_path, module, rounds=1)
    assert module.trainer.global_step == 0


def test_full_gradient_algorithms_are_refused(tmp_path):
    svrg = A.FedAvgSVRG(snapshots=1, inner_steps=LOCAL.steps)  # local work it can run: refused for record-level DP alone
    module = _module(svrg, RecordPrivacy())
    with pytest.raises(ValueError, match="record_privacy: FedAvgSVRG does not declare record_level_dp"):
        _fit(tmp_path, module, rounds=1)


def test_a_batch_larger_than_a_client_is_refused(tmp_path):
    module = _module(A.FedAvg(), RecordPrivacy(), local=LocalTraining(lr=0.1, steps=2, batch_size=10_000))
    with pytest.raises(ValueError, match=r"sampling rate B / n_i would exceed 1 \(must be in \(0, 1\]\)"):
        _fit(tmp_path, module, rounds=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(clip_norm=0.0), "record_privacy.clip_norm must be > 0"),
        (dict(clip_norm=float("inf")), "record_privacy.clip_norm must be > 0"),
        (dict(noise_multiplier=-0.1), "record_privacy.noise_multiplier must be >= 0"),
        (dict(delta=0.0), r"record_privacy.delta must be in \(0, 1\)"),
        (dict(delta=1.0), r"record_privacy.delta must be in \(0, 1\)"),
        (dict(sampling="shuffle"), "record_privacy.sampling must be 'poisson' or 'fixed'"),
        (dict(sampling_rate=0.0), r"record_privacy.sampling_rate must be in \(0, 1\]"),
        (dict(sampling_rate=1.5), r"record_privacy.sampling_rate must be in \(0, 1\]"),
        (dict(sampling="fixed", sampling_rate=0.5), "record_privacy.sampling_rate applies to sampling='poisson' only"),
        (dict(accountant="moments"), "record_privacy.accountant must be 'rdp' or 'pld'"),
        (dict(sampling="fixed", accountant="pld"), "record_privacy.accountant='pld' supports sampling='poisson' only"),
    ],
)
def test_bad_settings_are_rejected_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecordPrivacy(**kwargs)


# ---- DDP -------------------------------------------------------------------------------------------------------
def test_ddp_equals_one_process_under_record_level_dp(tmp_path):
    """Two DDP processes (gloo): each runs its own clients' DP-SGD steps from their round seeds; the accountant
    counts every task's steps on every rank: the one-process model to float tolerance, the same epsilon."""
    from tests.test_distributed import _assert_close, _train

    single = _train(tmp_path, 1, "fedavg", False, "--record-privacy", "0.5", "1.0")
    ddp = _train(tmp_path, 2, "fedavg", False, "--record-privacy", "0.5", "1.0")
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert single["metrics"]["privacy/record_epsilon"] == ddp["metrics"]["privacy/record_epsilon"] > 0


def test_the_terminal_shows_both_guarantees_with_their_method_and_delta():
    """The progress bar's ``eps`` / ``record eps`` and the closing line's ``epsilon`` / ``record epsilon``, each with
    the method and delta it is stated at (an infinite epsilon, sigma = 0, reads ``inf``)."""
    from types import SimpleNamespace

    from fl_lightning.pipeline.privacy import ClientPrivacy
    from fl_lightning.run.terminal import RoundProgressBar, RunSummary

    metrics = {"train/loss": torch.tensor(0.5), "privacy/epsilon": torch.tensor(3.214), "privacy/record_epsilon": torch.tensor(float("inf"))}
    trainer = SimpleNamespace(callback_metrics=metrics, global_step=7)
    module = SimpleNamespace(
        privacy=ClientPrivacy(delta=1e-4, accountant="pld"), record_privacy=RecordPrivacy(noise_multiplier=0.0, delta=1e-5)
    )
    assert RoundProgressBar()._postfix(trainer) == "train loss 0.500 · eps 3.21 · record eps inf"
    summary = RunSummary()
    summary.on_fit_start(trainer, module)
    summary.on_fit_end(trainer, module)
    assert summary.line().endswith(" · epsilon 3.21 (PLD, delta 0.0001) · record epsilon inf (RDP, delta 1e-05)")
