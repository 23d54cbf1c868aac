"""Natural users (datamodules/leaf.py, leaf_module.py; docs/fairness.md, "Natural users"): a LEAF folder written
here in the FEMNIST schema becomes one client per user holding exactly its samples in order, its LEAF test samples
its held-out split; a malformed file is refused in one line naming it; configs/leaf_femnist.yaml fits through the CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import LeafDataModule
from datamodules.leaf import SHAKESPEARE_LETTERS, read_leaf
from fl_lightning.core.participation import UniformSampling
from tests.conftest import fit_shipped_config

ROOT = Path(__file__).resolve().parents[1]
USERS, PER_FILE = 12, 4


def _user(rng: np.random.Generator, n: int) -> dict:
    """n FEMNIST samples: pixels k / 255 (JSON floats that float32 does not hold exactly) and labels in [0, 62)."""
    return {"x": (rng.integers(0, 256, (n, 784)) / 255).tolist(), "y": rng.integers(0, 62, n).tolist()}


def write_leaf(root: Path, seed: int = 0, test_only: int = 1) -> dict[str, dict]:
    """USERS users in files of PER_FILE (train: 6..14 samples each, test: 2..5), plus ``test_only`` users found only
    in the last test file (LEAF's held-out users); returns {split: {user: data}} in file order."""
    rng = np.random.default_rng(seed)
    names = [f"f{i:04d}_{rng.integers(100)}" for i in range(USERS)]
    written: dict[str, dict] = {"train": {}, "test": {}}
    for split, (low, high) in (("train", (6, 15)), ("test", (2, 6))):
        (root / split).mkdir(parents=True)
        for f in range(USERS // PER_FILE):
            users = names[f * PER_FILE : (f + 1) * PER_FILE]
            if split == "test" and f == USERS // PER_FILE - 1:
                users = users + [f"only_test_{i}" for i in range(test_only)]
            data = {u: _user(rng, int(rng.integers(low, high))) for u in users}
            written[split].update(data)
            body = {"users": users, "num_samples": [len(d["y"]) for d in data.values()], "user_data": data}
            (root / split / f"all_data_{f}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(body))
    return written


def _rows(data: dict, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(data["x"], dtype=dtype).view(-1, 1, 28, 28), torch.tensor(data["y"], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [None, "float64"])
def test_each_user_is_one_client_with_exactly_its_samples_and_its_test_split(tmp_path, dtype):
    written = write_leaf(tmp_path)
    data = LeafDataModule(str(tmp_path), participation=UniformSampling(4), dtype=dtype)
    data.setup()
    cast = torch.float64 if dtype else torch.float32
    train_users = list(written["train"])
    assert data.num_clients == USERS and data.leaf.users == train_users and data.num_classes == 62
    for client, user in enumerate(train_users):
        x, y = data.client_full_batch(client)
        want_x, want_y = _rows(written["train"][user], cast)
        assert x.dtype == cast and torch.equal(x, want_x) and torch.equal(y, want_y)  # in order, bit for bit
        hx, hy = data.client_holdout_batch(client)
        want_hx, want_hy = _rows(written["test"][user], cast)
        assert torch.equal(hx, want_hx) and torch.equal(hy, want_hy)
        halves = [data.client_holdout_part(client, p) for p in ("validation", "test")]  # selection and report: disjoint, all of it
        assert torch.equal(torch.cat(halves).sort().values, data.client_holdout[client]) and len(halves[0]) == len(hy) // 2
    assert torch.equal(data.client_sizes, torch.tensor([len(written["train"][u]["y"]) for u in train_users]))
    # the global test set: every test sample in file order, the test-only user's included
    test_x, test_y = data.source.test.tensors
    every = [_rows(d, cast) for d in written["test"].values()]
    assert torch.equal(test_x, torch.cat([x for x, _ in every])) and torch.equal(test_y, torch.cat([y for _, y in every]))
    assert test_x.data_ptr() == data.source.train.tensors[0][data.leaf.num_train :].data_ptr()  # a view: held once


def test_num_clients_takes_the_first_users_and_a_validation_share_is_drawn_from_their_training_samples(tmp_path):
    written = write_leaf(tmp_path)
    data = LeafDataModule(str(tmp_path), num_clients=5, participation=UniformSampling(2), val_fraction=0.34)
    data.setup()
    users = list(written["train"])[:5]
    assert data.leaf.users == users and data.num_clients == 5
    assert len(data.source.test) == sum(len(written["test"][u]["y"]) for u in [*users, "only_test_0"])
    for client, user in enumerate(users):
        n = len(written["train"][user]["y"])
        own = set(range(int(data.leaf.train.offsets[client]), int(data.leaf.train.offsets[client + 1])))
        train = set(data.client_train[client].tolist())
        val = own - train
        assert train <= own and len(val) == int(0.34 * n) and val <= set(data.validation_indices.tolist())
    assert len(data.validation_indices) == sum(int(0.34 * len(written["train"][u]["y"])) for u in users)
    with pytest.raises(ValueError, match=r"^data.num_clients=13 exceeds the 12 users with training samples in "):
        LeafDataModule(str(tmp_path), num_clients=13, participation=UniformSampling(2)).setup()


def _fedavg_reference(written: dict, x: dict, model, rounds: int, lr: float) -> dict:
    """FedAvg from the written JSON alone: every client one full-batch GD step a round, weights n_k / n."""
    clients = [_rows(d, torch.float64) for d in written["train"].values()]
    n = sum(len(y) for _, y in clients)
    for _ in range(rounds):
        new = {k: torch.zeros_like(v) for k, v in x.items()}
        for inputs, target in clients:
            w = {k: v.clone().requires_grad_() for k, v in x.items()}
            loss = torch.nn.functional.cross_entropy(torch.func.functional_call(model, w, (inputs,)), target)
            for (k, v), g in zip(w.items(), torch.autograd.grad(loss, list(w.values()))):
                new[k] += len(target) / n * (v - lr * g).detach()
        x = new
    return x


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_fedavg_on_the_users_matches_a_reference_from_the_json_in_float64(tmp_path, execution):
    from fl_lightning import algorithms
    from fl_lightning.core.config import LocalTraining
    from fl_lightning.engine.module import FederatedModule
    from models import MLP
    from tests.conftest import tiny_trainer

    written = write_leaf(tmp_path / "leaf")
    torch.manual_seed(0)
    model = MLP(in_features=784, num_classes=62, hidden=[4]).double()
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    # one epoch of batch 16: each client (6..14 samples) takes one full-batch step; batched, the clients' unequal
    # batches are padded and masked into one stacked step
    local = LocalTraining(lr=0.5, steps=None, epochs=1, batch_size=16)
    module = FederatedModule(model, algorithms.FedAvg(), local, execution=execution)
    data = LeafDataModule(str(tmp_path / "leaf"), participation=UniformSampling(USERS, weighting="samples"), dtype="float64")
    tiny_trainer(tmp_path, 2, precision="64-true").fit(module, datamodule=data)
    if execution == "batched":
        assert not module.executor.fallbacks  # stacked, not run client by client
    expected = _fedavg_reference(written, initial, model, 2, 0.5)
    for name, value in module.model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[name], rtol=1e-12, atol=1e-12)
    assert all(not torch.equal(expected[k], initial[k]) for k in initial)  # it trained


def test_a_malformed_file_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from fl_lightning.commands.cli import main

    write_leaf(tmp_path)
    monkeypatch.chdir(tmp_path)
    bad = sorted((tmp_path / "train").glob("*.json"))[1]
    body = json.loads(bad.read_text())
    body["num_samples"][2] += 1
    bad.write_text(json.dumps(body))
    with pytest.raises(ValueError) as error:
        LeafDataModule(str(tmp_path), participation=UniformSampling(2)).setup()
    user = body["users"][2]
    line = f"{bad}: user {user!r} has num_samples {body['num_samples'][2]} but {body['num_samples'][2] - 1} x and {body['num_samples'][2] - 1} y"
    assert str(error.value) == line
    with pytest.raises(SystemExit) as stop:  # the CLI: exit code 2 and that line
        main(["fit", "--config", str(ROOT / "configs" / "leaf_femnist.yaml"), "--data.init_args.root", str(tmp_path),
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"])  # fmt: skip
    assert stop.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == f"fl-lightning: error: {line}"
    body["num_samples"][2] -= 1
    body["user_data"][user]["x"][0] = body["user_data"][user]["x"][0][:-1]  # 783 pixels
    bad.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=rf"^{bad}: user {user!r}: ") as error:
        read_leaf(str(tmp_path))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^data.root: .*nowhere is not a folder"):
        LeafDataModule(str(tmp_path / "nowhere"))
    for old in (tmp_path / "test").glob("*.json"):
        old.unlink()
    with pytest.raises(ValueError, match=rf"^data.root: {tmp_path / 'test'} holds no .json file"):
        LeafDataModule(str(tmp_path))


def test_shakespeare_rows_are_the_codes_of_leafs_alphabet(tmp_path):
    text = "".join(SHAKESPEARE_LETTERS[(7 * i) % 80] for i in range(81))
    lines = [text[:80], text[1:81]]
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        body = {"users": ["ROMEO"], "num_samples": [2], "user_data": {"ROMEO": {"x": lines, "y": [text[80], "é"]}}}
        (tmp_path / split / "a.json").write_text(json.dumps(body))
    leaf = read_leaf(str(tmp_path), "shakespeare")
    want = torch.tensor([[SHAKESPEARE_LETTERS.index(c) for c in line] for line in lines])
    assert torch.equal(leaf.x[:2], want) and leaf.y[:2].tolist() == [SHAKESPEARE_LETTERS.index(text[80]), 80]  # 80: not in it
    assert leaf.num_classes == 81 and leaf.x.dtype == torch.int64


def test_the_femnist_config_fits_through_the_cli_on_a_leaf_folder(tmp_path, monkeypatch):
    from fl_lightning.commands.cli import main

    write_leaf(tmp_path / "leaf")
    monkeypatch.chdir(tmp_path)  # a folder outside the checkout, the config by its path
    main(["fit", "--config", str(ROOT / "configs" / "leaf_femnist.yaml"), "--data.init_args.root", str(tmp_path / "leaf"),
          "--data.init_args.participation.init_args.clients_per_round", "4", "--trainer.max_steps", "2",
          "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"])  # fmt: skip
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    every = list(csv.DictReader(metrics.open()))
    rows = [r for r in every if r.get("val/personal_acc_mean")]
    assert rows and 0 <= float(rows[-1]["val/personal_acc_worst10"]) <= float(rows[-1]["val/personal_acc_mean"]) <= 1
    assert any(r.get("test/acc") for r in every)


class LabelBlocks:
    """A partitioner with Flower Datasets' interface (``dataset`` set, ``load_partition(i)`` a ``datasets.Dataset``): the
    samples sorted by ``partition_by`` and cut into ``num_partitions`` contiguous blocks, each block shuffled by ``seed``.
    flwr-datasets itself pins ``datasets < 5``, which this project's environment cannot install beside its own."""

    def __init__(self, num_partitions: int, partition_by: str = "label", seed: int = 0) -> None:
        self.num_partitions, self.partition_by, self.seed, self.dataset = num_partitions, partition_by, seed, None

    def load_partition(self, partition_id: int):
        order = np.argsort(np.asarray(self.dataset[self.partition_by]), kind="stable")
        block = np.array_split(order, self.num_partitions)[partition_id]
        return self.dataset.select(np.random.default_rng(self.seed + partition_id).permutation(block).tolist())


class Drops(LabelBlocks):
    """Keeps one sample of each partition: not a federated partition."""

    def load_partition(self, partition_id: int):
        return super().load_partition(partition_id).select(range(1))


def test_a_flower_datasets_partitioner_is_a_partition_of_any_source(tmp_path, monkeypatch):
    """``FlwrPartition`` gives client c the samples of the partitioner's ``load_partition(c)`` on a locally built
    ``datasets.Dataset`` of the source's labels (saved to disk and read back, as a user's data would be), with
    num_partitions and seed filled in; a partitioner that drops samples is refused in one line; a YAML config runs."""
    import datasets

    from datamodules import FederatedDataModule, FlwrPartition

    data = FederatedDataModule("digits", {}, num_clients=5, partition=FlwrPartition("tests.test_natural_users.LabelBlocks"), seed=3)
    data.setup()
    labels = data.source.train_labels
    datasets.Dataset.from_dict({"label": labels.tolist(), "__index__": list(range(len(labels)))}).save_to_disk(str(tmp_path / "ds"))
    direct = LabelBlocks(5, seed=3)
    direct.dataset = datasets.load_from_disk(str(tmp_path / "ds"))
    for c in range(5):
        assert sorted(direct.load_partition(c)["__index__"]) == data.client_train[c].tolist()
    assert len({int(labels[i]) for i in data.client_train[0]}) <= 3  # blocks of sorted labels: label skew
    with pytest.raises(ValueError, match=r"FlwrPartition: .*Drops's 5 partitions hold 5 distinct of the \d+ samples"):
        FlwrPartition(f"{__name__}.Drops")(labels, 5, 0)
    with pytest.raises(ValueError, match="FlwrPartition partitioner 'no.such.Partitioner' is not an importable class"):
        FlwrPartition("no.such.Partitioner")(labels, 5, 0)
    partition = {"class_path": "fl_lightning.datamodules.FlwrPartition", "init_args": {"partitioner": "tests.test_natural_users.LabelBlocks"}}
    rows = fit_shipped_config(tmp_path, monkeypatch, "quickstart", "--data.init_args.partition", json.dumps(partition), "--trainer.callbacks", "[]")
    assert any(r.get("val/acc") for r in rows)
