"""A LoRA aggregation method on the causal LM (``LoRACausalLM``, Dolly-schema fixture): FedEx-LoRA's round is the
mean of the clients' updates, and the export with its folded base generates the framework's text."""

from __future__ import annotations

import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.run.export import ExportPretrained
from models import LoRACausalLM
from tests.conftest import tiny_trainer
from tests.test_instruction_tuning import assets, dolly, one_thread  # noqa: F401  (fixtures)
from tests.test_lora_aggregation_runs import Recording, client_mean, effective

pytestmark = pytest.mark.filterwarnings("ignore")


def test_fedex_on_the_causal_lm_is_exact_and_exports_a_base_that_generates_the_same_text(assets, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = LoRACausalLM(str(assets.gpt2), rank=4, alpha=8.0, dropout=0.0)
    algorithm = Recording()
    algorithm.watch = model
    m = FederatedModule(model=model, algorithm=algorithm, local=LocalTraining(lr=0.5, steps=3, batch_size=4), lora_aggregation="exact_residual")
    data, export = dolly(assets), tmp_path / "adapter"
    tiny_trainer(tmp_path, rounds=2, callbacks=[ExportPretrained(str(export))]).fit(m, datamodule=data)
    x, deltas, weights, w0 = algorithm.last
    want, got = client_mean(m, x, deltas, weights), effective(m)
    for layer in m.model.lora_layers():
        assert torch.allclose(got[layer.base], w0[layer.base] + want[layer.b], atol=1e-6)
    prompt = data.test_examples[0]["prompt"]
    ours = m.model.generate(data.tokenizer(), [prompt], max_new_tokens=12)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(export)).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = reloaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == ours
    batch = data.source.test.gather(torch.arange(2))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits[:, :-1],
                                   m.model(batch["input_ids"], batch["attention_mask"]), rtol=0, atol=1e-5)  # fmt: skip
