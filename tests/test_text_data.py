"""TextDataModule on GLUE- and 20NG-schema parquet files: fields, caching, padding, partition, bad input."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from datamodules import IID, TASKS, Dirichlet, TextDataModule
from datamodules.text import load_tokenizer
from fl_lightning import UniformSampling
from tests.text_fixtures import shared_assets

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


def make(assets, task, files, num_clients=4, partition=None, **kw) -> TextDataModule:
    return TextDataModule(
        task=task,
        tokenizer=str(assets.tokenizer),
        data_files=files,
        cache_dir=str(assets.cache),
        num_clients=num_clients,
        partition=partition or IID(),
        participation=UniformSampling(2),
        **kw,
    )


def test_sentence_pairs_are_joined_with_the_separator(assets):
    dm = make(assets, "qnli", assets.qnli, pair_separator="\n")
    dm.setup()
    tok = load_tokenizer(str(assets.tokenizer))
    frame = pd.read_parquet(assets.qnli["train"])
    ids, label = dm.source.train[0]
    assert tok.decode(ids) == frame["question"][0] + "\n" + frame["sentence"][0]
    assert label == frame["label"][0]
    assert dm.num_classes == 2 and len(dm.source.test) == len(pd.read_parquet(assets.qnli["validation"]))


def test_20news_has_20_classes_and_empty_posts_become_one_token(assets):
    dm = make(assets, "20news", assets.news, num_clients=8, partition=Dirichlet(0.1, min_size=2))
    dm.setup()
    assert dm.num_classes == 20
    ids, _ = dm.source.train[0]  # the fixture's first post is empty
    assert ids.tolist() == [load_tokenizer(str(assets.tokenizer)).eos_token_id]
    labels = dm.source.train_labels
    classes_per_client = [len(labels[idx].unique()) for idx in dm.client_train]
    assert sum(len(i) for i in dm.client_train) == len(labels)
    assert sum(classes_per_client) / len(classes_per_client) < 10, "Dir(0.1) should give label skew"


def test_batches_are_padded_to_their_longest_sequence(assets):
    dm = make(assets, "sst2", assets.sst2, max_length=6)
    dm.setup()
    lengths = dm.source.train.lengths()
    assert int(lengths.max()) <= 6
    batch = next(dm.client_batches(0, seed=1, batch_size=5, steps=1))
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())
    pad = load_tokenizer(str(assets.tokenizer)).pad_token_id
    assert torch.all(batch["input_ids"][batch["attention_mask"] == 0] == pad)
    test_lengths = dm.source.test.lengths()
    assert torch.all(test_lengths[1:] >= test_lengths[:-1]), "evaluation set should be length-sorted"


def test_tokenization_is_cached(assets, monkeypatch):
    make(assets, "sst2", assets.sst2, max_length=20).setup()
    tokenizer_cls = type(load_tokenizer(str(assets.tokenizer)))
    calls = []
    original = tokenizer_cls.__call__
    monkeypatch.setattr(tokenizer_cls, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    make(assets, "sst2", assets.sst2, max_length=20).setup()
    assert calls == [], "second setup re-tokenized instead of reading the datasets cache"
    make(assets, "sst2", assets.sst2, max_length=21).setup()
    assert calls, "a different max_length must not reuse the cache"


def test_hub_datasets_go_through_the_same_loading_path(assets, monkeypatch):
    import datasets

    seen = []
    parquet = datasets.load_dataset("parquet", data_files=assets.sst2, cache_dir=str(assets.cache))

    def fake_load_dataset(path, name=None, **kw):
        seen.append((path, name))
        return parquet

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = TextDataModule(task="sst2", tokenizer=str(assets.tokenizer), num_clients=4, partition=IID())
    dm.setup()
    assert seen == [("nyu-mll/glue", "sst2")] and len(dm.source.train) == parquet["train"].num_rows
    assert TASKS["20news"].path == "SetFit/20_newsgroups" and TASKS["mnli"].eval_split == "validation_matched"


def test_bad_settings_are_rejected(assets, tmp_path):
    with pytest.raises(ValueError, match="unknown text task"):
        TextDataModule(task="stsb")
    with pytest.raises(ValueError, match="max_length"):
        TextDataModule(task="sst2", max_length=1)
    with pytest.raises(ValueError, match="'validation'"):
        TextDataModule(task="sst2", data_files={"train": assets.sst2["train"]})
    unlabelled = pd.read_parquet(assets.sst2["validation"]).assign(label=-1)
    files = {"train": assets.sst2["train"], "validation": str(tmp_path / "test.parquet")}
    unlabelled.to_parquet(files["validation"])
    with pytest.raises(ValueError, match="labels outside"):
        make(assets, "sst2", files).setup()
    with pytest.raises(ValueError, match="needs columns"):
        make(assets, "qnli", assets.sst2).setup()


@pytest.mark.parametrize("gather_rows", [1024, 7], ids=["one_gather", "gathered_in_blocks"])
@pytest.mark.parametrize("local", [(5, 3, None), (4, None, 2), (None, 2, None), (100, 2, None)], ids=["steps", "epochs", "full", "whole"])
def test_a_rounds_joint_draws_are_each_clients_batches(assets, local, gather_rows, monkeypatch):
    """``round_client_batches`` (sequential execution's one draw for the round) yields each client's ``client_batches``,
    its first K_i (stragglers), on text (each step padded to its longest) and on tensors, gathered at once or in blocks
    of steps (``ROUND_GATHER_ROWS``)."""
    import datamodules.federated as federated
    from tests.conftest import tiny_datamodule

    monkeypatch.setattr(federated, "ROUND_GATHER_ROWS", gather_rows)

    text = make(assets, "sst2", assets.sst2, num_clients=5, partition=Dirichlet(0.5), max_length=6)
    for dm in (text, tiny_datamodule(num_clients=5)):
        dm.setup()
        clients, seeds = [3, 0, 4, 1], [7, 2**40 + 1, 9, 11]
        own = [list(dm.client_batches(c, s, *local)) for c, s in zip(clients, seeds)]
        budgets = [max(1, len(b) - i % 2) for i, b in enumerate(own)]
        drawn = dm.round_client_batches(clients, seeds, *local, budgets)
        for batches, expected, k in zip(drawn, own, budgets):
            got = list(batches)
            assert len(got) == k
            for a, b in zip(got, expected[:k]):
                a, b = (a.values(), b.values()) if isinstance(a, dict) else (a, b)
                assert all(torch.equal(x, y) for x, y in zip(a, b))
