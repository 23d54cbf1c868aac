"""The offline instruction-tuning path of docs/instruction_tuning.md, run from the docs' own commands, and
what a wrong setting says: a sequence longer than the model's positions, every example dropped, a category
that loses its examples to max_length; the result line of a language model; one row per evaluation; the
adapter in the run's folder; no empty run folder after a failure."""

from __future__ import annotations

import csv
import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

from datamodules import IID, InstructionDataModule
from fl_lightning import FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import FedAvg
from fl_lightning.commands.lora_fixture import write_tiny_gpt2
from models import LoRACausalLM
from tests.conftest import tiny_trainer
from tests.instruction_fixtures import shared_instruction_assets
from tests.test_instruction_tuning import _cli

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "instruction_tuning.md"
TINY = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--model.local.steps", "2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_instruction_assets(tmp_path_factory)


def documented_commands() -> list[str]:
    """The commands of the docs' offline block (continuation lines joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S)
    [block] = [b for b in blocks if "lora-fixture" in b and "--instruction" in b]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("  #")[0].strip()
        if line:
            commands.append(" ".join(line.split()))
    return commands


def _after_cli(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("fl-lightning") + 1 :]


def test_the_documented_offline_commands_run_and_report_eval_loss_perplexity_and_rouge(tmp_path):
    fixture, fit = documented_commands()
    assert fixture.startswith("fl-lightning lora-fixture ") and fit.startswith("HF_HUB_OFFLINE=1 fl-lightning fit --config fedit_dolly ")
    made = _cli(_after_cli(fixture), tmp_path)
    assert made.returncode == 0, made.stderr[-2000:]
    assert " ".join(made.stdout.split()) == fit  # the docs show exactly what the command prints

    proc = _cli([*_after_cli(fit), *TINY], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = proc.stdout.strip().splitlines()[-1]
    assert result.startswith("LocalAdam: 2 rounds in "), result
    assert "val acc" not in result and "test acc" not in result
    assert re.search(r"final eval loss \d+\.\d+ · ppl \d+\.\d+ · ROUGE-L \d\.\d+ \(32 samples\)", result), result
    assert re.search(r"best eval loss \d+\.\d+ \(round \d\)", result), result

    [run] = list((tmp_path / "runs" / "fedit_dolly").glob("version_*"))
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    steps = [int(r["step"]) for r in rows if r.get("eval/loss")]
    assert steps == [0, 1]  # each evaluation's eval/* row once (the final test does not repeat it)
    categories = {c[len("eval/loss/") :] for c in rows[0] if c.startswith("eval/loss/")}
    assert len(categories) == 8  # every Dolly category is measured
    assert (run / "adapter" / "adapter_config.json").exists()  # the export is in the run's folder
    assert not (tmp_path / "runs" / "fedit_dolly" / "adapter").exists()
    assert f"adapter {run.relative_to(tmp_path) / 'adapter'}" in result


def test_a_sequence_longer_than_the_models_positions_is_one_line_and_leaves_no_run_folder(assets, tmp_path):
    short = write_tiny_gpt2(tmp_path / "gpt2_32", assets.tokenizer, n_positions=32)
    args = ["fit", "--config", "fedit_dolly", "--model.model.init_args.model_name_or_path", str(short),
            "--data.init_args.tokenizer", str(assets.tokenizer), "--data.init_args.dataset_path", str(assets.dolly),
            "--data.init_args.cache_dir", str(assets.root / "hf_cache"), "--data.init_args.num_clients", "6",
            "--data.init_args.val_fraction", "0.1", "--data.init_args.test_fraction", "0.1", *TINY]  # fmt: skip
    proc = _cli(args, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert re.search(r"data\.init_args\.max_length=512: the template \+ example needs up to \d+ tokens, but the model .* has 32 positions; "
                     r"set data\.init_args\.max_length <= 32", line), line  # fmt: skip
    assert "in_channels" not in line and "IndexError" not in line
    assert not list((tmp_path / "runs").rglob("version_*"))  # the failed run leaves no empty version_N


def _module(gpt2: Path) -> FederatedModule:
    torch.manual_seed(0)
    model = LoRACausalLM(str(gpt2), rank=2, alpha=4.0, dropout=0.0)
    return FederatedModule(model=model, algorithm=FedAvg(), local=LocalTraining(lr=0.01, steps=1, batch_size=4))


def test_the_position_check_also_stops_the_python_api_before_training(assets, tmp_path):
    short = write_tiny_gpt2(tmp_path / "gpt2_32", assets.tokenizer, n_positions=32)
    data = InstructionDataModule(dataset_path=str(assets.dolly), tokenizer=str(assets.tokenizer), max_length=256, num_clients=4,
                                 partition=IID(), participation=UniformSampling(2), cache_dir=str(assets.root / "hf_cache"), seed=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"needs up to \d+ tokens, but the model .* has 32 positions"):
        tiny_trainer(tmp_path, 1).fit(_module(short), datamodule=data)


def test_every_example_dropped_is_refused_in_one_line_naming_the_tokens_the_template_needs(assets):
    data = InstructionDataModule(dataset_path=str(assets.dolly), tokenizer=str(assets.tokenizer), max_length=8, num_clients=4,
                                 partition=IID(), cache_dir=str(assets.root / "hf_cache"), seed=0)  # fmt: skip
    with pytest.raises(ValueError) as error:
        data.setup()
    message = str(error.value)
    assert "\n" not in message
    assert re.search(r"data\.init_args\.max_length=8 leaves no response token in any example: the shortest prompt \(template \+ "
                     r"instruction \+ input\) needs \d+ tokens; set data\.init_args\.max_length above \d+", message), message  # fmt: skip


def test_a_category_losing_more_than_half_its_examples_is_named_and_a_vanished_one_too(assets, tmp_path, caplog):
    path = tmp_path / "dolly_long.jsonl"
    long_context = " ".join(["apple river stone cloud"] * 40)
    with open(path, "w") as f:
        for i in range(48):
            category = ["open_qa", "brainstorming", "summarization", "closed_qa"][i % 4]
            context = long_context if category == "summarization" or (category == "closed_qa" and i % 16 != 15) else ""
            f.write(json.dumps({"instruction": "Repeat the word apple twice.", "context": context, "response": "apple apple",
                                "category": category}) + "\n")  # fmt: skip
    data = InstructionDataModule(dataset_path=str(path), tokenizer=str(assets.tokenizer), max_length=96, num_clients=2,
                                 partition=IID(), cache_dir=str(tmp_path / "hf_cache"), seed=0, test_fraction=0.25)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="datamodules.instruction"):
        data.setup()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert re.search(r"category summarization loses all its 12 examples .*: it is left out of training and of every metric", text), text
    assert re.search(r"category closed_qa loses 9 of its 12 examples \(more than half\)", text), text
    assert "open_qa" not in text and "brainstorming" not in text
    assert data.dropped_by_category == {"closed_qa": (9, 12), "summarization": (12, 12)}


def test_generation_past_the_models_positions_is_refused_before_training(assets, tmp_path):
    from fl_lightning.engine.instruction_eval import InstructionEvaluation

    short = write_tiny_gpt2(tmp_path / "gpt2_96", assets.tokenizer, n_positions=96)
    data = InstructionDataModule(dataset_path=str(assets.dolly), tokenizer=str(assets.tokenizer), max_length=96, num_clients=4,
                                 partition=IID(), participation=UniformSampling(2), cache_dir=str(assets.root / "hf_cache"), seed=0)  # fmt: skip
    evaluation = InstructionEvaluation(num_samples=4, max_new_tokens=64)
    with pytest.raises(ValueError, match=r"InstructionEvaluation max_new_tokens=64: the longest sampled prompt has \d+ tokens and the model "
                                         r"has 96 positions; set max_new_tokens <= \d+"):  # fmt: skip
        tiny_trainer(tmp_path, 1, callbacks=[evaluation]).fit(_module(short), datamodule=data)


def test_the_result_line_of_a_language_model_without_instruction_evaluation_reports_the_response_loss():
    from fl_lightning.run.terminal import RunSummary

    summary = RunSummary()
    summary.name, summary.rounds, summary.seconds, summary.token_level = "FedAvg", 4, 1.0, True
    summary.loss_name, summary.losses = "val", [(2, 2.5), (4, 2.0)]
    summary.accuracies = [(2, 0.3), (4, 0.4)]  # next-token accuracy: not what the line reports
    line = summary.line()
    assert "val acc" not in line
    assert "final val loss 2.0000 · ppl 7.39 · best val loss 2.0000 (round 4)" in line, line
    assert "ROUGE-L" not in line  # not computed without InstructionEvaluation
