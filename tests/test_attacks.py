"""Each upload attack equals its formula (docs/algorithms.md, 26.2), written here again in numpy (float64),
on random uploads; the round's tamper replaces only the malicious uploads and logs their norms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from fl_lightning.adversary import ALIE, IPM, Attack, GaussianUpload, LabelFlip, MinMax, MinSum, ModelReplacement, RoundView, SignFlip
from fl_lightning.adversary.gaussian import GAUSSIAN_STREAM
from fl_lightning.adversary.malicious import choose_malicious
from fl_lightning.algorithms import FedAvg, FedProto, RoundInfo
from fl_lightning.core.participation import derive_seed
from fl_lightning.core.tasks import ClientResult, ClientTask

RNG = np.random.default_rng(7)
OWN, BENIGN = RNG.normal(size=(2, 40)), RNG.normal(0.3, 1.0, size=(7, 40))
VIEW = RoundView(round=3, reporting=9, malicious=2, global_lr=0.5, seeds=(11, 12))


def craft(attack) -> np.ndarray:
    return attack.craft(torch.tensor(OWN), torch.tensor(BENIGN), VIEW).numpy()


def test_sign_flip_scaling_and_ipm_are_their_formulas():
    np.testing.assert_allclose(craft(SignFlip(2.5)), -2.5 * OWN, rtol=0, atol=1e-15)
    np.testing.assert_allclose(craft(ModelReplacement()), (9 / 0.5) * OWN, rtol=1e-15)  # gamma = n / eta
    np.testing.assert_allclose(craft(ModelReplacement(gamma=3.0)), 3.0 * OWN, rtol=1e-15)
    expected = -0.7 * BENIGN.mean(axis=0)
    np.testing.assert_allclose(craft(IPM(0.7)), np.stack([expected, expected]), rtol=1e-12, atol=1e-15)


def test_gaussian_draws_from_each_malicious_clients_round_seed():
    out = craft(GaussianUpload(std=0.3))
    for row, seed in zip(out, VIEW.seeds):
        z = torch.randn(40, generator=torch.Generator().manual_seed(derive_seed(seed, GAUSSIAN_STREAM)), dtype=torch.float64)
        np.testing.assert_array_equal(row, 0.3 * z.numpy())
    assert not np.array_equal(out[0], out[1])


@pytest.mark.parametrize("n, f", [(9, 2), (10, 2), (25, 5), (3, 1)])
def test_alie_is_mean_minus_z_max_std(n, f):
    s = math.floor(n / 2 + 1) - f
    z = norm.ppf((n - f - s) / (n - f))
    view = RoundView(0, n, f)
    out = ALIE().craft(torch.tensor(OWN), torch.tensor(BENIGN), view).numpy()
    expected = BENIGN.mean(axis=0) - z * BENIGN.std(axis=0, ddof=1)
    np.testing.assert_allclose(out, np.stack([expected, expected]), rtol=1e-12, atol=1e-14)
    fixed = ALIE(z=1.5).craft(torch.tensor(OWN), torch.tensor(BENIGN), view).numpy()[0]
    np.testing.assert_allclose(fixed, BENIGN.mean(axis=0) - 1.5 * BENIGN.std(axis=0, ddof=1), rtol=1e-12, atol=1e-14)


def _search(ok, mu, p, gamma, tau):
    """The halving search of Shejwalkar and Houmansadr's release, again."""
    step, success = gamma, 0.0
    while abs(success - gamma) > tau:
        if ok(mu + gamma * p):
            success, gamma = gamma, gamma + step / 2
        else:
            gamma = gamma - step / 2
        step = step / 2
    return success


def _perturbation(kind):
    mu = BENIGN.mean(axis=0)
    return {"unit_vec": -mu / np.linalg.norm(mu), "sign": -np.sign(mu), "std": -BENIGN.std(axis=0, ddof=1)}[kind]


def _distances(m):
    return np.array([np.sqrt(((m - g) ** 2).sum()) for g in BENIGN])


@pytest.mark.parametrize("kind", ["unit_vec", "sign", "std"])
def test_min_max_and_min_sum_are_their_searches(kind):
    mu, p = BENIGN.mean(axis=0), _perturbation(kind)
    pairwise = np.array([[np.sqrt(((a - b) ** 2).sum()) for b in BENIGN] for a in BENIGN])
    gamma = _search(lambda m: _distances(m).max() <= pairwise.max(), mu, p, 10.0, 1e-5)
    np.testing.assert_allclose(craft(MinMax(kind))[1], mu + gamma * p, rtol=1e-12, atol=1e-13)
    assert _distances(mu + gamma * p).max() <= pairwise.max() and gamma > 0
    gamma = _search(lambda m: (_distances(m) ** 2).sum() <= (pairwise**2).sum(axis=1).min(), mu, p, 10.0, 1e-5)
    np.testing.assert_allclose(craft(MinSum(kind))[0], mu + gamma * p, rtol=1e-12, atol=1e-13)
    assert gamma > 0


def test_label_flip_maps_y_to_c_minus_1_minus_y_or_the_stated_map():
    y = torch.tensor([0, 3, 9, 5])
    assert LabelFlip().poison(torch.zeros(4, 2), y, 10, torch.Generator())[1].tolist() == [9, 6, 0, 4]
    assert LabelFlip({3: 8, 5: 1}).poison(torch.zeros(4, 2), y, 10, torch.Generator())[1].tolist() == [0, 8, 9, 1]


def test_the_malicious_set_is_fixed_by_the_seed():
    a, b = choose_malicious(20, 5, 0.2), choose_malicious(20, 5, 0.2)
    assert a == b and len(a) == 4 and all(0 <= c < 20 for c in a.ids) and list(a.ids) == sorted(a.ids)
    assert choose_malicious(20, 6, 0.2) != a
    assert len(choose_malicious(20, 5, 0.01)) == 1 and len(choose_malicious(20, 5, 0.0)) == 0
    assert choose_malicious(20, 5, clients=[7, 2]).ids == (2, 7)
    with pytest.raises(ValueError, match=r"attack.fraction must be in \[0, 1\), got 1.0"):
        Attack(fraction=1.0, upload=SignFlip())
    with pytest.raises(ValueError, match="attack sets neither attack.data nor attack.upload"):
        Attack(fraction=0.2)
    with pytest.raises(ValueError, match=r"attack.clients must be distinct ids in \[0, 20\)"):
        choose_malicious(20, 5, clients=[20])


def _round(seed_ids=(0, 1, 2, 3, 4)):
    """Five clients' uploads of two entries (SCAFFOLD-like), float32."""
    gen = torch.Generator().manual_seed(3)
    results, tasks = [], []
    for cid in seed_ids:
        upload = {"delta": {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)},
                  "delta_c": {"w": torch.randn(3, 2, generator=gen), "b": torch.randn(2, generator=gen)}}  # fmt: skip
        results.append(ClientResult(cid, upload, {}, 1, 0.0))
        tasks.append(ClientTask(cid, 100 + cid, 1, {}, lambda: None))
    return results, tasks


def _flat(upload):
    return np.concatenate([t.double().numpy().ravel() for td in upload.values() for t in td.values()])


def test_tamper_replaces_only_the_malicious_uploads_from_the_benign_ones():
    results, tasks = _round()
    attack = Attack(clients=[1, 3], upload=IPM(0.5))
    attack.prepare(5, 0, 10, FedAvg(), 1, False)
    out = attack.tamper(results, tasks, RoundInfo(0, 0.1, 5), FedAvg())
    benign = np.stack([_flat(results[i].upload) for i in (0, 2, 4)])
    for i in (0, 2, 4):
        assert out[i] is results[i]
    for i in (1, 3):
        np.testing.assert_allclose(_flat(out[i].upload), -0.5 * benign.mean(axis=0), rtol=1e-6, atol=1e-7)
        assert out[i].upload["delta_c"]["w"].shape == (3, 2) and out[i].upload["delta"]["b"].dtype == torch.float32
    metrics = attack.round_metrics()
    assert metrics["attack/malicious_clients"] == 2.0
    assert metrics["attack/norm_benign"] == pytest.approx(np.linalg.norm(benign, axis=1).mean(), rel=1e-6)
    assert metrics["attack/norm_malicious"] == pytest.approx(np.linalg.norm(0.5 * benign.mean(axis=0)), rel=1e-6)
    assert attack.round_metrics() == {}


def test_an_attack_needing_benign_uploads_is_skipped_with_fewer_than_two(caplog):
    results, tasks = _round((0, 1, 2))
    attack = Attack(clients=[0, 1], upload=ALIE())
    attack.prepare(3, 0, 10, FedAvg(), 1, False)
    out = attack.tamper(results, tasks, RoundInfo(4, 0.1, 3), FedAvg())
    assert all(a is b for a, b in zip(out, results))
    assert "round 4: attack.upload ALIE needs at least 2 benign uploads, the round has 1" in caplog.text


@pytest.mark.parametrize(
    "attack, algorithm, processes, record_privacy, message",
    [
        (Attack(0.2, upload=MinMax()), FedProto(), 1, False, "attack.upload MinMax cannot attack FedProto: its uploads are not shaped like the model"),
        (Attack(0.2, upload=ALIE()), FedAvg(), 2, False, "attack.upload ALIE reads every benign upload of the round, but under DDP (2 processes)"),
        (Attack(0.2, data=LabelFlip()), FedAvg(), 1, True, "attack.data cannot poison record-level DP-SGD's sampled records"),
        (Attack(0.2, data=LabelFlip({1: 10})), FedAvg(), 1, False, r"attack.data LabelFlip.mapping classes must be in [0, 10), got 10"),
    ],
    ids=["fedproto", "ddp", "record_privacy", "mapping"],
)
def test_settings_without_a_meaning_are_refused_before_training(attack, algorithm, processes, record_privacy, message):
    with pytest.raises(ValueError) as refused:
        attack.prepare(20, 0, 10, algorithm, processes, record_privacy)
    assert message in str(refused.value) and "\n" not in str(refused.value)


class _TextLike:
    def client_full_batch(self, client_id):
        return {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}


def test_data_poisoning_is_checked_on_a_malicious_clients_batch_before_training():
    from fl_lightning.adversary import Backdoor

    attack = Attack(0.2, data=LabelFlip())
    attack.prepare(20, 0, 10, FedAvg(), 1, False)
    with pytest.raises(ValueError, match=r"attack.data poisons \(inputs, labels\) batches of tensors"):
        attack.check_data(_TextLike())
    attack = Attack(0.2, data=Backdoor(patch=9))
    attack.prepare(20, 0, 10, FedAvg(), 1, False)

    class Digits:
        def client_full_batch(self, client_id):
            return torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)

    with pytest.raises(ValueError, match=r"attack.data Backdoor.patch=9 is larger than the images \(\(8, 8\)\)"):
        attack.check_data(Digits())
