"""Batched federated LoRA: the round's clients as rows of one batch through the shared frozen base.

Every test asserts that the rounds ran stacked as client rows (``Objective._as_rows``), not by a
fallback to sequential execution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import SCAFFOLD, FAdamET, FAdamGT, FedAvg, FedProx, LocalAdam
from fl_lightning.run.export import ExportPretrained
from fl_lightning.core.objective import Objective
from models import LoRAClassifier
from tests.conftest import tiny_trainer
from tests.test_lora import FedAvgWithState, one_thread, sst2  # noqa: F401  (one_thread: an autouse fixture)
from tests.text_fixtures import _WORDS, shared_assets

pytestmark = pytest.mark.filterwarnings("ignore")

ALGORITHMS = {
    "fedavg": FedAvg,
    "fedprox": lambda: FedProx(mu=0.1),
    "scaffold": SCAFFOLD,
    "local_adam": lambda: LocalAdam(global_lr=0.3),
    "fadam_et": lambda: FAdamET(global_lr=0.3, tracking=1.0),
    "fadam_gt": lambda: FAdamGT(global_lr=0.3, tracking=1.0),
}


class ElementwiseFedAvgWithState(FedAvgWithState):
    elementwise = True  # its client_finish copies the final adapters: elementwise, and now declared


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


def lora(algorithm, execution: str, **local) -> FederatedModule:
    torch.manual_seed(0)
    model = LoRAClassifier(local.pop("path"), num_labels=2, rank=2, alpha=4.0, dropout=0.0)
    settings = dict(lr=0.1, steps=3, batch_size=8)
    settings.update(local)
    return FederatedModule(model=model, algorithm=algorithm, local=LocalTraining(**settings), execution=execution)


def fit(assets, tmp_path, algorithm_fn, execution, rounds=3, data=None, **trainer_kw):
    module = lora(algorithm_fn(), execution, path=str(assets.gpt2))
    trainer = tiny_trainer(tmp_path / execution, rounds=rounds, **trainer_kw)
    trainer.fit(module, datamodule=data() if data else sst2(assets, num_clients=6, per_round=3))
    return module


def assert_same(seq, bat, atol=1e-5):
    for (name, a), b in zip(seq.model.named_parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=name)
    sa, sb = seq.store.state_dict(), bat.store.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=atol, msg=k)


# docs/algorithms.md, E13
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_batched_lora_equals_sequential(assets, tmp_path, rows_calls, name):
    seq = fit(assets, tmp_path, ALGORITHMS[name], "sequential")
    assert not rows_calls
    bat = fit(assets, tmp_path, ALGORITHMS[name], "batched")
    assert not bat.executor.inner.fallbacks
    assert len(rows_calls) == 3 * 3 and all(shape[0] == 3 for shape in rows_calls)  # rounds x steps, S = 3 stacked
    assert_same(seq, bat)
    x0 = lora(FedAvg(), "sequential", path=str(assets.gpt2)).global_params()
    assert any(not torch.allclose(x0[n], p) for n, p in bat.global_params().items()), "the adapters did not train"


def _ragged_sst2(root, n=96, seed=3):
    """SST-2-schema files whose sentences run from 1 to 30 words: most of every batch is padding."""
    import pandas as pd

    rng = np.random.default_rng(seed)
    files = {}
    for split, size in (("train", n), ("validation", 16)):
        labels = rng.integers(0, 2, size=size)
        lengths = np.where(rng.random(size) < 0.7, 1, rng.integers(10, 31, size=size))
        text = [" ".join(rng.choice(_WORDS, size=k)) for k in lengths]
        files[split] = str(root / f"ragged_{split}.parquet")
        pd.DataFrame({"sentence": text, "label": labels, "idx": np.arange(size)}).to_parquet(files[split])
    return files


def test_padding_heavy_batches_give_the_sequential_result(assets, tmp_path, rows_calls):
    files = _ragged_sst2(tmp_path)
    data = sst2(assets, num_clients=6, per_round=3, data_files=files)
    data.setup()
    lengths = data.source.train.lengths()
    assert lengths.max() >= 20 and (lengths <= 5).float().mean() > 0.5  # padding dominates most batches

    def fresh():
        return sst2(assets, num_clients=6, per_round=3, data_files=files)

    seq = fit(assets, tmp_path, SCAFFOLD, "sequential", data=fresh)
    bat = fit(assets, tmp_path, SCAFFOLD, "batched", data=fresh)
    assert not bat.executor.inner.fallbacks and rows_calls
    assert_same(seq, bat)


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_local_epochs_stack_text_clients_of_unequal_work(assets, tmp_path, rows_calls, name):
    """``local.epochs`` over a Dirichlet split: clients run different K and short last batches, padded and masked
    (every step padded to its longest sample), with sequential execution's result; SCAFFOLD's finish reads K_i."""
    from fl_lightning.datamodules import Dirichlet

    def data():
        return sst2(assets, num_clients=6, per_round=3, partition=Dirichlet(alpha=0.3))

    def run(execution):
        module = lora(ALGORITHMS[name](), execution, path=str(assets.gpt2), steps=None, epochs=1, batch_size=8)
        tiny_trainer(tmp_path / execution, rounds=3).fit(module, datamodule=data())
        return module

    seq = run("sequential")
    bat = run("batched")
    stats = bat.executor.inner.stats
    assert not bat.executor.inner.fallbacks and stats["stacked_rounds"] == 3 and rows_calls
    assert stats["padded_work"] > 0  # the clients' work was unequal: steps or rows were padded
    assert_same(seq, bat)


def test_stacked_text_batches_are_the_clients_batches_padded_to_one_length(assets):
    data = sst2(assets, num_clients=6, per_round=3)
    data.setup()
    clients, seeds = [0, 3, 5], [11, 12, 13]
    stacked = list(data.stacked_client_batches(clients, seeds, 8, 2))
    for step, batch in enumerate(stacked):
        width = batch["input_ids"].shape[-1]
        for i, (c, s) in enumerate(zip(clients, seeds)):
            own = list(data.client_batches(c, s, 8, 2))[step]
            n = own["input_ids"].shape[-1]
            assert n <= width
            assert torch.equal(batch["input_ids"][i, :, :n], own["input_ids"])
            assert torch.equal(batch["attention_mask"][i, :, :n], own["attention_mask"])
            assert not batch["attention_mask"][i, :, n:].any()
            assert torch.equal(batch["labels"][i], own["labels"])


def test_batched_lora_resume_is_bitwise_identical(assets, tmp_path, rows_calls):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt_path=None):
        module = lora(ElementwiseFedAvgWithState(), "batched", path=str(assets.gpt2), steps=2)
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds=rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=sst2(assets, num_clients=6, per_round=3), ckpt_path=ckpt_path)
        assert not module.executor.inner.fallbacks
        return module

    straight = run(tmp_path / "a", rounds=3)
    run(tmp_path / "b", rounds=2)
    resumed = run(tmp_path / "c", rounds=3, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    assert rows_calls
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)


def test_adapter_exported_from_a_batched_run_loads_with_peft_and_predicts_like_the_model(assets, tmp_path, rows_calls):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    export = tmp_path / "adapter"
    module = fit(assets, tmp_path, FedAvg, "batched", rounds=2, callbacks=[ExportPretrained(str(export))])
    assert rows_calls and not module.executor.inner.fallbacks
    base = AutoModelForSequenceClassification.from_pretrained(str(assets.gpt2), num_labels=2)
    base.config.pad_token_id = base.config.eos_token_id
    reloaded = PeftModel.from_pretrained(base, str(export)).eval()
    data = sst2(assets, num_clients=6, per_round=3)
    data.setup()
    batch = data.client_full_batch(0)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, module.model(**inputs), rtol=0, atol=1e-6)
        untrained = lora(FedAvg(), "sequential", path=str(assets.gpt2)).model.eval()(**inputs)
    assert (module.model(**inputs) - untrained).abs().max() > 1e-4


def test_client_rows_need_the_models_own_declaration(assets):
    class Subclass(LoRAClassifier):  # its own forward: the parent's claim does not carry over
        def forward(self, input_ids, attention_mask=None):
            return super().forward(input_ids, attention_mask)

    names = lambda m: [n for n, p in m.named_parameters() if p.requires_grad]  # noqa: E731
    declared = LoRAClassifier(str(assets.gpt2), num_labels=2, rank=2)
    undeclared = Subclass(str(assets.gpt2), num_labels=2, rank=2)
    assert Objective(declared, names(declared)).rows is not None
    assert Objective(undeclared, names(undeclared)).rows is None


def test_an_undeclared_rule_runs_per_client_under_vmap_through_gpt2(assets, tmp_path):
    """A rule without ``elementwise = True`` runs under vmap; GPT-2 traces under vmap because
    ``LoRAClassifier`` hands transformers a built 4D mask (no branch on the mask's values)."""
    seq = fit(assets, tmp_path, FedAvgWithState, "sequential", rounds=2)
    bat = fit(assets, tmp_path, FedAvgWithState, "batched", rounds=2)
    assert not bat.executor.inner.fallbacks
    assert_same(seq, bat)


class BranchingMLP(torch.nn.Module):
    """A model whose forward branches on a tensor's value: vmap cannot trace it."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x) if x.sum() > -1e9 else -self.net(x)


def test_an_undeclared_rule_falls_back_with_its_reason_when_the_model_cannot_run_under_vmap(tmp_path, caplog):
    import logging

    from fl_lightning.algorithms import FedSAM
    from tests.conftest import tiny_datamodule

    def run(execution):
        torch.manual_seed(0)
        module = FederatedModule(BranchingMLP(), FedSAM(), LocalTraining(lr=0.1, steps=2, batch_size=8), execution=execution)
        tiny_trainer(tmp_path / execution, rounds=2).fit(module, datamodule=tiny_datamodule())
        return module

    with caplog.at_level(logging.WARNING, logger="fl_lightning.executors.batched"):
        bat = run("batched")
    assert "FedSAM does not declare elementwise = True" in caplog.text and "cannot run under vmap" in caplog.text
    assert sum(bat.executor.inner.fallbacks.values()) == 2
    seq = run("sequential")
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        assert torch.equal(a, b)


def test_sequential_compiled_text_runs_one_dynamic_program(assets, tmp_path):
    """Text batches are as wide as their longest sequence, a width that changes from step to step: under sequential
    compiled execution they run the dynamic program (before: a static program compiled again for each round's widths,
    until ``max_variants`` sent the run eager), with eager execution's results."""
    from fl_lightning.executors import SequentialExecutor

    data = lambda: sst2(assets, num_clients=6, per_round=3)  # noqa: E731
    eager = fit(assets, tmp_path, FedAvg, "sequential", rounds=3, data=data)
    executor = SequentialExecutor(compile=True, backend="eager")
    module = lora(FedAvg(), executor, path=str(assets.gpt2))
    widths = []
    guarded = executor.programs._guarded

    def counted(unit_fn, dynamic, new, args):
        widths.extend(b["input_ids"].shape[-1] for b in args[-2])  # the round program's batches
        return guarded(unit_fn, dynamic, new, args)

    executor.programs._guarded = counted
    tiny_trainer(tmp_path / "compiled", rounds=3).fit(module, datamodule=data())
    assert len(set(widths)) >= 3  # the steps' widths differ
    assert not executor.fallbacks and {dynamic for _, dynamic in executor.programs.variants} == {True}
    assert executor.programs.compiled <= 2  # a batch of one row aside, one graph for every width
    assert_same(eager, module)
