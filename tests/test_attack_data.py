"""Data poisoning (docs/algorithms.md, 26.2): the backdoor's trigger is its formula, a malicious client's
batches are poisoned by (seed, round, client, step) alike under sequential and batched execution, a run with
an attack trains the same either way, and resumes bitwise (the malicious set is derived from the seed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from datamodules import IID, FederatedDataModule
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.adversary import Attack, Backdoor, LabelFlip, SignFlip
from fl_lightning.adversary.malicious import choose_malicious
from models import MLP
from tests.conftest import tiny_trainer


def test_the_trigger_is_a_corner_patch_on_images_and_square_flat_inputs():
    x = np.random.default_rng(0).uniform(size=(5, 1, 8, 8))
    expected = x.copy()
    expected[..., 5:, 5:] = 0.9
    backdoor = Backdoor(target=2, patch=3, value=0.9)
    np.testing.assert_array_equal(backdoor.stamp(torch.tensor(x)).numpy(), expected)
    np.testing.assert_array_equal(backdoor.stamp(torch.tensor(x.reshape(5, 64))).numpy(), expected.reshape(5, 64))
    inputs, labels = backdoor.triggered(torch.tensor(x), torch.tensor([2, 0, 2, 7, 1]))
    assert labels.tolist() == [2, 2, 2] and np.array_equal(inputs.numpy(), expected[[1, 3, 4]])


def test_the_backdoor_poisons_round_fraction_b_samples_of_a_batch():
    x, y = torch.rand(10, 1, 8, 8), torch.arange(10)
    kept = x.clone()
    px, py = Backdoor(target=4, fraction=0.3).poison(x, y, 10, torch.Generator().manual_seed(1))
    changed = (py != y) | (px != x).flatten(1).any(1)
    poisoned = torch.tensor([bool((px[i, :, -2:, -2:] == 1).all()) and py[i] == 4 for i in range(10)])
    assert int(poisoned.sum()) == 3 and bool((changed <= poisoned).all())
    assert torch.equal(x, kept) and torch.equal(y, torch.arange(10))  # the input batch is left as it was


def _digits(num_clients=8, per_round=4):
    data = FederatedDataModule("digits", num_clients=num_clients, partition=IID(), participation=UniformSampling(per_round), seed=3)
    data.setup()
    return data


@pytest.mark.parametrize("poisoning", [Backdoor(target=1, fraction=0.5), LabelFlip()], ids=["backdoor", "label_flip"])
def test_sequential_and_stacked_batches_are_poisoned_alike(poisoning):
    data = _digits()
    attack = Attack(clients=[2, 5], data=poisoning)
    attack.prepare(data.num_clients, data.seed, data.num_classes, FedAvg(), 1, False)
    view = attack.data_view(data)
    clients, seeds = [1, 2, 5], [101, 102, 105]
    stacked = list(view.stacked_client_batches(clients, seeds, 8, 3))
    for s, (cid, seed) in enumerate(zip(clients, seeds)):
        single = list(view.client_batches(cid, seed, 8, 3))
        clean = list(data.client_batches(cid, seed, 8, 3))
        for k in range(3):
            assert torch.equal(stacked[k][0][s], single[k][0]) and torch.equal(stacked[k][1][s], single[k][1])
            poisoned = not (torch.equal(single[k][0], clean[k][0]) and torch.equal(single[k][1], clean[k][1]))
            assert poisoned == (cid in (2, 5))
    again = list(view.client_batches(2, 102, 8, 3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(again, list(view.client_batches(2, 102, 8, 3))))
    assert view.augments_batches is data.augments_batches  # the data's other attributes are forwarded
    with pytest.raises(AttributeError, match="would not be poisoned"):
        view.future_client_batches  # noqa: B018 (a source of batches it does not poison is not)
    drawn = view.round_client_batches(clients, seeds, 8, 3, None, [3, 3, 3])
    assert all(torch.equal(a[0], b[0]) for s, (cid, seed) in enumerate(zip(clients, seeds)) for a, b in zip(drawn[s], view.client_batches(cid, seed, 8, 3)))
    full = view.client_full_batch(5)
    if isinstance(poisoning, LabelFlip):
        assert torch.equal(full[1], 9 - data.client_full_batch(5)[1])
        assert torch.equal(view.client_label_counts(5), data.client_label_counts(5).flip(0))


def _module(attack, execution="sequential", local=None):
    torch.manual_seed(0)
    local = local or LocalTraining(lr=0.1, steps=3, batch_size=8)
    return FederatedModule(MLP(64, 10, hidden=[16]), FedAvg(), local, execution=execution, attack=attack)


@pytest.mark.parametrize("local", [None, LocalTraining(lr=0.1, steps=None, epochs=1, batch_size=40)], ids=["steps", "epochs"])
def test_a_run_with_an_attack_trains_the_same_sequentially_and_batched(tmp_path, local):
    """With ``local.epochs`` each client's last batch is short: batched rounds pad and mask (masked stacking), and the
    malicious clients' padded batches are poisoned as their sequential ones are (their real rows, step by step)."""
    modules = {}
    for execution in ("sequential", "batched"):
        module = _module(Attack(fraction=0.25, data=Backdoor(target=0, fraction=0.5), upload=SignFlip(2.0)), execution, local)
        tiny_trainer(tmp_path, 3).fit(module, datamodule=_digits(per_round=8))  # every client, the 2 malicious ones included
        modules[execution] = module
    assert not modules["batched"].executor.fallbacks and modules["batched"].executor.inner.fallbacks == {}  # every round ran stacked
    if local is not None:
        assert modules["batched"].executor.inner.stats["padded_work"] > 0  # the rounds were padded
    assert modules["sequential"].attack.malicious == choose_malicious(8, 3, 0.25) and len(choose_malicious(8, 3, 0.25)) == 2
    assert modules["sequential"].trainer.callback_metrics["attack/norm_malicious"] > 0
    for a, b in zip(modules["sequential"].model.parameters(), modules["batched"].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fit(tmp_path, rounds, ckpt_path=None):
    module = _module(Attack(fraction=0.25, data=LabelFlip(), upload=SignFlip(1.5)))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint]).fit(module, datamodule=_digits(), ckpt_path=ckpt_path)
    return module


def test_a_run_with_an_attack_resumes_bitwise(tmp_path):
    straight = _fit(tmp_path / "a", 4)
    _fit(tmp_path / "b", 2)
    resumed = _fit(tmp_path / "c", 4, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert straight.attack.malicious == resumed.attack.malicious
