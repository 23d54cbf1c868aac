"""Federated LoRA (FedIT) on a tiny GPT-2: what is federated, what stays frozen, export, memory."""

from __future__ import annotations

import pytest
from pathlib import Path

import torch

from datamodules import IID, Partitioner, TextDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.core import params as P
from fl_lightning.algorithms import FedAvg
from fl_lightning.run.export import ExportPretrained
from models import LoRAClassifier
from tests.conftest import tiny_trainer
from tests.text_fixtures import shared_assets

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is ~5x faster than two contending."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


def recording(algorithm):
    """Keep every round's global params and upload payloads (clones) on ``algorithm.records``."""
    base_aggregate = algorithm.aggregate
    algorithm.records = []

    def aggregate(x, uploads, weights, server_state, info, local_steps):
        algorithm.records.append((P.detach_clone(x), [{k: P.detach_clone(v) for k, v in u.items()} for u in uploads]))
        return base_aggregate(x, uploads, weights, server_state, info, local_steps)

    algorithm.aggregate = aggregate
    return algorithm


class FedAvgWithState(FedAvg):
    """FedAvg that also keeps each client's last local model as client state (to exercise the store)."""

    def client_state_init(self, x):
        return {"last": P.zeros_like(x)}

    def client_finish(self, params, local, ctx):
        upload, _ = super().client_finish(params, local, ctx)
        return upload, {"last": P.detach_clone(params)}


class Replicated(Partitioner):
    """Client c gets rows [c*m, (c+1)*m) of a train set made of N identical copies of m rows."""

    def __call__(self, labels, num_clients, seed):
        m = len(labels) // num_clients
        return [torch.arange(c * m, (c + 1) * m) for c in range(num_clients)]


def sst2(assets, num_clients=4, per_round=2, partition=None, data_files=None, **kw) -> TextDataModule:
    return TextDataModule(
        task="sst2",
        tokenizer=str(assets.tokenizer),
        data_files=data_files or assets.sst2,
        cache_dir=str(assets.cache),
        max_length=32,
        num_clients=num_clients,
        partition=partition or IID(),
        participation=UniformSampling(per_round),
        eval_batch_size=64,
        **kw,
    )


def lora_module(assets, algorithm=None, freeze_a=False, lr=0.05, **local) -> FederatedModule:
    torch.manual_seed(0)
    model = LoRAClassifier(str(assets.gpt2), num_labels=2, rank=2, alpha=4.0, dropout=0.0, freeze_a=freeze_a)
    settings = dict(lr=lr, steps=None, epochs=1, batch_size=16)
    settings.update(local)
    return FederatedModule(model=model, algorithm=algorithm, local=LocalTraining(**settings))


def adapter_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".lora_" in n or ".modules_to_save." in n}


def _algorithms():
    from fl_lightning.algorithms import SCAFFOLD, FAdamET, FAdamGT, LocalAdam

    return {  # FedIT-* = the Adam family on the adapters, Y = S (seed sec. 6.3)
        "FedIT-Adam": lambda: LocalAdam(global_lr=0.3),
        "FedIT-AdamET": lambda: FAdamET(global_lr=0.3, tracking=1.0),
        "FedIT-AdamGT": lambda: FAdamGT(global_lr=0.3, tracking=1.0),
        "FedAvg": FedAvg,
        "SCAFFOLD": SCAFFOLD,
    }


ALGORITHMS = list(_algorithms())


@pytest.mark.parametrize("name", ["FedAvgWithState", *ALGORITHMS])
def test_only_adapters_and_head_are_federated_stored_and_sent(assets, tmp_path, name):
    algorithm = FedAvgWithState() if name == "FedAvgWithState" else _algorithms()[name]()
    module = lora_module(assets, recording(algorithm))
    names = set(module.federated_names)
    assert names and names <= adapter_names(module.model)
    assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
    assert any("score" in n for n in names)
    base_before = {n: p.detach().clone() for n, p in module.model.named_parameters() if n not in names}
    x0 = P.detach_clone(module.global_params())

    tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=sst2(assets))

    for _, uploads in module.algorithm.records:
        for upload in uploads:
            for td in upload.values():
                assert set(td) <= names
    stored = module.store.state_dict()
    assert stored or name == "FedAvg"
    assert {key.split("/", 2)[2] for key in stored} <= names
    after = dict(module.model.named_parameters())
    for n, p in base_before.items():
        assert torch.equal(after[n], p), f"frozen base tensor {n} changed"
    assert not all(torch.equal(x0[n], after[n]) for n in names), "the adapters did not train"


# docs/algorithms.md, E12
@pytest.mark.parametrize("name", ALGORITHMS)
def test_identical_clients_return_their_common_adapter(assets, tmp_path, name):
    """docs/algorithms.md, E12: if all clients end with the same adapter, the global adapter is that adapter."""
    data_one = sst2(assets, num_clients=1, per_round=1)
    one = lora_module(assets, recording(_algorithms()[name]()), batch_size=None, steps=2, epochs=None)
    tiny_trainer(tmp_path / "one", rounds=1).fit(one, datamodule=data_one)
    rows = len(data_one.source.train)

    import pandas as pd

    files = dict(assets.sst2)
    frame = pd.read_parquet(files["train"])
    files["train"] = str(tmp_path / "replicated.parquet")
    pd.concat([frame] * 3, ignore_index=True).to_parquet(files["train"])
    data_three = sst2(assets, num_clients=3, per_round=3, partition=Replicated(), data_files=files)
    three = lora_module(assets, recording(_algorithms()[name]()), batch_size=None, steps=2, epochs=None)
    tiny_trainer(tmp_path / "three", rounds=1).fit(three, datamodule=data_three)
    assert len(data_three.source.train) == 3 * rows

    uploads = three.algorithm.records[0][1]
    for u in uploads[1:]:
        for n in three.federated_names:
            assert torch.equal(u["delta"][n], uploads[0]["delta"][n]), "clients with the same data diverged"
    for n in one.federated_names:
        torch.testing.assert_close(three.global_params()[n], one.global_params()[n], rtol=0, atol=1e-7)


def _merged_updates(module, x, deltas):
    """Per adapted layer: (alpha/r) * B A at x + delta, for each delta (B A is what the model adds to W)."""
    named = dict(module.model.named_parameters())
    scale = 4.0 / 2
    out = []
    for delta in deltas:
        layers = {}
        for n in named:
            if ".lora_A." in n:
                b = n.replace(".lora_A.", ".lora_B.")
                a_val = (x[n] + delta[n]) if n in x else named[n].detach()
                layers[n] = scale * (x[b] + delta[b]) @ a_val
        out.append(layers)
    return out


# docs/algorithms.md, E12
@pytest.mark.parametrize("freeze_a", [True, False])
def test_freeze_a_makes_averaging_exact(assets, tmp_path, freeze_a):
    """FedIT averages A and B separately: mean(B) mean(A) != mean(B A). With A frozen it is exact."""
    module = lora_module(assets, recording(FedAvg()), freeze_a=freeze_a, lr=0.2, steps=3, epochs=None, batch_size=8)
    assert any(".lora_A." in n for n in module.federated_names) != freeze_a
    tiny_trainer(tmp_path, rounds=2).fit(module, datamodule=sst2(assets, num_clients=4, per_round=4))
    x, uploads = module.algorithm.records[-1]
    clients = _merged_updates(module, x, [u["delta"] for u in uploads])
    (global_,) = _merged_updates(module, module.global_params(), [P.zeros_like(module.global_params())])
    gap = max(float((global_[k] - sum(c[k] for c in clients) / len(clients)).abs().max()) for k in global_)
    if freeze_a:
        assert gap < 1e-6
    else:
        assert gap > 1e-5, "expected FedIT's product-of-means error"


def test_exported_adapter_reloads_with_peft_and_gives_the_same_logits(assets, tmp_path, monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    monkeypatch.chdir(Path(assets.gpt2).parent)  # the base named as a user types it: relative to the working directory
    torch.manual_seed(0)
    module = FederatedModule(LoRAClassifier(Path(assets.gpt2).name, num_labels=2, rank=2, alpha=4.0, dropout=0.0),
                             local=LocalTraining(lr=0.05, steps=None, epochs=1, batch_size=16))  # fmt: skip
    data = sst2(assets)
    export = tmp_path / "adapter"
    tiny_trainer(tmp_path, rounds=2, callbacks=[ExportPretrained(str(export))]).fit(module, datamodule=data)
    saved = load_file(str(export / "adapter_model.safetensors"))
    assert saved and all(".lora_" in k or "score" in k for k in saved)

    base = AutoModelForSequenceClassification.from_pretrained(str(assets.gpt2), num_labels=2)
    base.config.pad_token_id = base.config.eos_token_id
    reloaded = PeftModel.from_pretrained(base, str(export)).eval()
    module.model.eval()
    batch = data.client_full_batch(0)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        expected = module.model(**inputs)
        got = reloaded(**inputs).logits
        untrained = lora_module(assets).model.eval()(**inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert (expected - untrained).abs().max() > 1e-4, "export test is vacuous: training did not move the logits"
    import json

    named = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(named).is_absolute() and Path(named) == Path(assets.gpt2).resolve()  # loads from any working directory
    monkeypatch.chdir(tmp_path / "adapter")  # elsewhere than the run's folder
    from peft import AutoPeftModelForSequenceClassification

    anywhere = AutoPeftModelForSequenceClassification.from_pretrained(str(export), num_labels=2, pad_token_id=base.config.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(anywhere.eval()(**inputs).logits, expected, rtol=0, atol=1e-6)


def test_memory_grows_only_by_adapter_state_per_client(assets, tmp_path):
    """One frozen base serves all clients: the store holds adapter-sized state, the model is never copied."""
    sizes = {}
    for per_round in (1, 4):
        module = lora_module(assets, FedAvgWithState())
        numel_before = sum(p.numel() for p in module.model.parameters())
        tiny_trainer(tmp_path / str(per_round), rounds=1).fit(
            module, datamodule=sst2(assets, num_clients=4, per_round=per_round)
        )
        assert sum(p.numel() for p in module.model.parameters()) == numel_before
        adapter_bytes = P.num_bytes(module.global_params().values())
        stored = module.store.state_dict()
        sizes[per_round] = (P.num_bytes(stored.values()), adapter_bytes, numel_before)
    (one, adapter, numel), (four, _, _) = sizes[1], sizes[4]
    assert one == adapter and four == 4 * adapter
    assert adapter < 0.2 * numel * 4, "adapter state should be a small fraction of the model"


def test_export_rejects_models_without_save_pretrained(tmp_path):
    from tests.conftest import tiny_datamodule, tiny_module

    with pytest.raises(ValueError, match="save_pretrained"):
        tiny_trainer(tmp_path, rounds=1, callbacks=[ExportPretrained(str(tmp_path / "x"))]).fit(
            tiny_module(), datamodule=tiny_datamodule()
        )
    with pytest.raises(ValueError, match="every_n_rounds"):
        ExportPretrained(every_n_rounds=0)


def test_lora_settings_are_checked_and_gpt2_conv1d_is_handled(assets):
    for kw, name in [({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"), ({"num_labels": 1}, "num_labels")]:
        with pytest.raises(ValueError, match=name):
            LoRAClassifier(str(assets.gpt2), **kw)
    model = LoRAClassifier(str(assets.gpt2), num_labels=3, rank=2)
    config = model.net.peft_config["default"]
    assert config.fan_in_fan_out is True and set(config.target_modules) == {"c_attn"}
    assert model.net.base_model.model.config.pad_token_id == model.net.base_model.model.config.eos_token_id
    assert model.training and not any(p.requires_grad for n, p in model.named_parameters() if n not in adapter_names(model))


def test_lora_resume_is_bitwise_identical(assets, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt_path=None):
        module = lora_module(assets, FedAvgWithState(), lr=0.1, steps=2, epochs=None, batch_size=8)
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds=rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=sst2(assets, per_round=2), ckpt_path=ckpt_path)
        return module

    straight = run(tmp_path / "a", rounds=3)
    run(tmp_path / "b", rounds=2)
    resumed = run(tmp_path / "c", rounds=3, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)


def test_exported_adapter_loads_with_the_peft_auto_class_and_its_tokenizer_and_predicts_a_batch(assets, tmp_path):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoConfig, AutoTokenizer

    module = lora_module(assets)
    data = sst2(assets)
    export = tmp_path / "adapter"
    tiny_trainer(tmp_path, rounds=2, callbacks=[ExportPretrained(str(export))]).fit(module, datamodule=data)
    assert (export / "tokenizer_config.json").is_file() and (export / "config.json").is_file()

    config = AutoConfig.from_pretrained(str(export))
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    assert config.num_labels == 2 and config.pad_token_id is not None
    assert tokenizer.pad_token_id == config.pad_token_id  # padded positions are the ones the head skips
    model = AutoPeftModelForSequenceClassification.from_pretrained(
        str(export), num_labels=config.num_labels, pad_token_id=config.pad_token_id
    ).eval()
    texts = ["a fine film", "the plot was dull and far too long for what it had to say", "good"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")  # lengths differ: a padded batch of 3
    assert (batch["attention_mask"] == 0).any()
    module.model.eval()
    with torch.no_grad():
        got = model(**batch).logits
        expected = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        one_by_one = torch.cat([module.model(**tokenizer([t], return_tensors="pt")) for t in texts])
    assert got.shape == (3, 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, one_by_one, rtol=0, atol=1e-5)  # padding changes nothing
