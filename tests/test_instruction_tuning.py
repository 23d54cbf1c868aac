"""Federated instruction tuning on a tiny random GPT-2 and Dolly/Alpaca-schema files written locally:
the response-only loss, batched = sequential, resume, export + generation, the partition, the CLI."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from datamodules import IID, Dirichlet, InstructionDataModule, NaturalPartition
from datamodules.instruction import IGNORE_INDEX, detect_schema, format_prompt
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import FAdamGT, FedAvg
from fl_lightning.run.export import ExportPretrained
from models import LoRACausalLM
from tests.conftest import tiny_trainer
from tests.instruction_fixtures import DOLLY_CATEGORIES, shared_instruction_assets

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_instruction_assets(tmp_path_factory)


def dolly(assets, num_clients=6, per_round=3, partition=None, **kw) -> InstructionDataModule:
    return InstructionDataModule(
        dataset_path=str(assets.dolly), tokenizer=str(assets.tokenizer), max_length=128, num_clients=num_clients,
        partition=partition or Dirichlet(0.5, min_size=4), participation=UniformSampling(per_round),
        cache_dir=str(assets.root / "hf_cache"), seed=0, eval_batch_size=8, **kw,
    )  # fmt: skip


def lm(assets, algorithm, execution="sequential", **local) -> FederatedModule:
    torch.manual_seed(0)
    settings = dict(lr=0.01, steps=3, batch_size=4)
    settings.update(local)
    model = LoRACausalLM(str(assets.gpt2), rank=4, alpha=8.0, dropout=0.0)
    return FederatedModule(model=model, algorithm=algorithm, local=LocalTraining(**settings), execution=execution)


# ---- data -----------------------------------------------------------------------------------
def test_schemas_are_recognised_by_their_columns_and_prompts_follow_the_alpaca_template(assets):
    assert detect_schema(["instruction", "context", "response", "category"]) == "dolly"
    assert detect_schema(["instruction", "input", "output"]) == "alpaca"
    with pytest.raises(ValueError, match="Alpaca columns"):
        detect_schema(["question", "answer"])
    assert format_prompt("alpaca", "Do X.", "").endswith("### Instruction:\nDo X.\n\n### Response:\n")
    assert "### Input:\nctx\n\n### Response:\n" in format_prompt("alpaca", "Do X.", "ctx")
    data = InstructionDataModule(dataset_path=str(assets.alpaca), tokenizer=str(assets.tokenizer), max_length=128,
                                 num_clients=4, partition=IID(), cache_dir=str(assets.root / "hf_cache"))  # fmt: skip
    data.setup()
    assert data.schema == "alpaca" and data.num_classes == 1 and int(data.client_sizes.sum()) == len(data.source.train)


def test_labels_mark_exactly_the_response_tokens(assets):
    data = dolly(assets)
    data.setup()
    train = data.source.train
    batch = train.gather(torch.arange(4))
    for row in range(4):
        prompt, response = train.tokens(row)
        length, cut = len(prompt) + len(response), len(prompt)
        labels, ids = batch["labels"][row], batch["input_ids"][row]
        assert torch.equal(ids[:length], torch.cat([prompt, response]))
        assert (labels[: cut - 1] == IGNORE_INDEX).all() and (labels[length - 1 :] == IGNORE_INDEX).all()
        assert torch.equal(labels[cut - 1 : length - 1], response)  # position t predicts token t + 1
    assert int(response[-1]) == data.tokenizer().eos_token_id  # the response is closed by <eos>


def test_the_loss_is_transformers_response_only_loss_and_ignores_prompt_tokens(assets):
    """The loss equals transformers' own causal-LM loss with the prompt masked (an independent
    reference), and its gradient with respect to every prompt position's logits is exactly zero:
    whatever the target of a prompt token, it does not count."""
    from transformers import AutoModelForCausalLM

    data = dolly(assets)
    data.setup()
    batch = data.source.train.gather(torch.arange(6))
    model = LoRACausalLM(str(assets.gpt2), rank=4, dropout=0.0).eval()
    logits = model(batch["input_ids"], batch["attention_mask"]).detach().requires_grad_(True)
    loss = model.loss(logits, batch["labels"])
    reference = AutoModelForCausalLM.from_pretrained(str(assets.gpt2)).eval()  # LoRA B starts at zero: the same function
    hf_labels = torch.cat([torch.full_like(batch["labels"][:, :1], IGNORE_INDEX), batch["labels"]], dim=1)
    with torch.no_grad():
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=hf_labels).loss
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    prompt = batch["labels"] == IGNORE_INDEX
    assert prompt.any() and (grad[prompt] == 0).all() and (grad[~prompt].abs().sum(-1) > 0).all()
    changed = batch["labels"].clone()
    changed[prompt] = 7  # ... would count if it were not masked
    assert not torch.isclose(model.loss(logits, changed), loss)


def test_representation_and_head_compose_to_the_forward(assets):
    data = dolly(assets)
    data.setup()
    batch = data.source.train.gather(torch.arange(3))
    model = LoRACausalLM(str(assets.gpt2), rank=4, dropout=0.0).eval()
    with torch.no_grad():
        z = model.representation(batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(model.head(z), model(batch["input_ids"], batch["attention_mask"]), rtol=1e-5, atol=1e-5)


def test_natural_partition_keeps_each_users_examples_on_one_client(assets):
    data = dolly(assets, partition=NaturalPartition("user"), natural_columns=["user"])
    data.setup()
    users = data.source.columns["user"]
    owners = [set(users[idx].tolist()) for idx in data.client_train]
    assert all(len(o) == 1 for o in owners) and len(set().union(*owners)) == 6
    with pytest.raises(ValueError, match="fewer than num_clients=9; set num_clients <= 6"):
        dolly(assets, num_clients=9, partition=NaturalPartition("user"), natural_columns=["user"]).setup()
    with pytest.raises(ValueError, match="does not offer; offered: \\[\\]"):
        dolly(assets, partition=NaturalPartition("user")).setup()


# ---- training -------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", [FedAvg, FAdamGT], ids=["FedAvg", "FAdamGT"])
def test_batched_causal_lm_equals_sequential_as_client_rows(assets, tmp_path, rows_calls, algorithm):
    modules = {}
    for execution in ("sequential", "batched"):
        modules[execution] = lm(assets, algorithm(), execution)
        tiny_trainer(tmp_path / execution, rounds=2).fit(modules[execution], datamodule=dolly(assets))
    seq, bat = modules["sequential"], modules["batched"]
    assert rows_calls and not bat.executor.inner.fallbacks
    for (name, a), b in zip(seq.model.named_parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    states = seq.store.state_dict(), bat.store.state_dict()
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_local_epochs_stack_instruction_clients_of_unequal_work(assets, tmp_path, rows_calls):
    """``local.epochs`` over Dirichlet clients: unequal K and short last batches, padded rows' token labels all
    -100, which the model declares its loss ignores (``loss_ignores_padded_rows``); sequential execution's result."""
    modules = {}
    for execution in ("sequential", "batched"):
        modules[execution] = lm(assets, FedAvg(), execution, steps=None, epochs=1, batch_size=4)
        tiny_trainer(tmp_path / execution, rounds=2).fit(modules[execution], datamodule=dolly(assets))
    seq, bat = modules["sequential"], modules["batched"]
    stats = bat.executor.inner.stats
    assert rows_calls and not bat.executor.inner.fallbacks and stats["stacked_rounds"] == 2 and stats["padded_work"] > 0
    for (name, a), b in zip(seq.model.named_parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_causal_lm_resume_is_bitwise_identical(assets, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt_path=None):
        module = lm(assets, FAdamGT(), steps=2)
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds=rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=dolly(assets), ckpt_path=ckpt_path)
        return module

    straight = run(tmp_path / "a", rounds=3)
    run(tmp_path / "b", rounds=2)
    resumed = run(tmp_path / "c", rounds=3, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)


def test_exported_adapter_generates_the_text_of_the_model_in_the_framework(assets, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    export = tmp_path / "adapter"
    module = lm(assets, FedAvg(), lr=0.5)
    data = dolly(assets)
    tiny_trainer(tmp_path, rounds=2, callbacks=[ExportPretrained(str(export))]).fit(module, datamodule=data)
    prompt = data.test_examples[0]["prompt"]
    ours = module.model.generate(data.tokenizer(), [prompt], max_new_tokens=12)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(export))  # the tokenizer travels with the adapter
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(export)).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = reloaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == ours
    untrained = LoRACausalLM(str(assets.gpt2), rank=4, dropout=0.0)  # training moved the adapters
    batch = data.source.test.gather(torch.arange(2))
    with torch.no_grad():
        assert (module.model(batch["input_ids"], batch["attention_mask"]) - untrained(batch["input_ids"], batch["attention_mask"])).abs().max() > 1e-4


# ---- the command line -------------------------------------------------------------------------
def _cli(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "fl_lightning.commands.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _local(assets) -> list[str]:
    return [
        "--model.model.init_args.model_name_or_path", str(assets.gpt2), "--model.model.init_args.rank", "2",
        "--data.init_args.dataset_path", str(assets.dolly), "--data.init_args.tokenizer", str(assets.tokenizer),
        "--data.init_args.max_length", "128", "--data.init_args.num_clients", "6", "--data.init_args.cache_dir", str(assets.root / "hf_cache"),
        "--data.init_args.participation.init_args.clients_per_round", "3", "--data.init_args.test_fraction", "0.1",
        "--data.init_args.partition.init_args.min_size", "4", "--model.local.steps", "2", "--model.local.batch_size", "4",
        "--data.init_args.holdout_fraction", "0.2", "--data.init_args.val_fraction", "0.1",
    ]  # fmt: skip


def test_fedit_dolly_config_trains_and_evaluates_by_category_and_generation_from_the_cli(assets, tmp_path):
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: fl_lightning.engine.instruction_eval.InstructionEvaluation\n"
        "      init_args: {num_samples: 3, max_new_tokens: 6}\n"
        f"    - class_path: fl_lightning.run.export.ExportPretrained\n      init_args: {{dirpath: {tmp_path / 'adapter'}}}\n"
    )
    proc = _cli(["fit", "--config", str(ROOT / "configs" / "fedit_dolly_batched.yaml"), "--config", str(callbacks), *_local(assets),
                 "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(tmp_path),
                 "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [metrics] = list((tmp_path / "runs").rglob("metrics.csv"))
    rows = list(csv.DictReader(open(metrics)))
    columns = set(rows[0])
    assert {"eval/rougeL", "eval/ppl", "eval/gen_samples", "eval/clients/ppl_mean", "eval/clients/ppl_worst10"} <= columns
    assert any(f"eval/loss/{c}" in columns for c in DOLLY_CATEGORIES)
    values = [float(r["eval/rougeL"]) for r in rows if r.get("eval/rougeL")]
    assert values and 0.0 <= values[0] <= 1.0
    [table] = list(metrics.parent.glob("generations_round_*.csv"))
    assert len(list(csv.DictReader(open(table)))) == 3
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


def test_partition_command_plots_a_dirichlet_split_of_dolly_by_category(assets, tmp_path):
    out = tmp_path / "partition.png"
    proc = _cli(["partition", "--config", str(ROOT / "configs" / "fedit_dolly.yaml"), *_local(assets), "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists() and out.with_suffix(".csv").exists()
    header = out.with_suffix(".csv").read_text().splitlines()[0]
    assert header == ",".join(["client", *DOLLY_CATEGORIES, "total"])  # the classes are Dolly's categories
