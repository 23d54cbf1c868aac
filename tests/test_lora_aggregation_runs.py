"""The LoRA aggregation methods (docs/algorithms.md, section 28) in runs of a tiny GPT-2: the model's update is
what each method claims, FedIT stays bitwise the same, heterogeneous ranks batched = sequential, refusals."""

from __future__ import annotations

import pytest
import torch

from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.algorithms import FedAvg, LocalAdam
from fl_lightning.core import params as P
from fl_lightning.lora import SVD, Factors, ZeroPad
from models import LoRAClassifier
from tests.conftest import tiny_trainer
from tests.test_lora import assets, one_thread, sst2  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore")


class Recording(FedAvg):
    """FedAvg that keeps the last round's x, uploads, weights and (``watch``: a model) its frozen weights then."""

    watch = None

    def aggregate(self, x, uploads, weights, server_state, info, local_steps):
        named = dict(self.watch.named_parameters()) if self.watch is not None else {}
        w0 = {l.base: named[l.base].detach().clone() for l in self.watch.lora_layers()} if named else {}
        self.last = (P.detach_clone(x), [P.detach_clone(u["delta"]) for u in uploads], weights.clone(), w0)
        self.clients = info.plan.clients.tolist()  # every selected client reports here (no faults)
        return super().aggregate(x, uploads, weights, server_state, info, local_steps)


def module(assets, aggregation=None, algorithm=None, execution="sequential", rank=4, **kw):
    torch.manual_seed(0)
    model = LoRAClassifier(str(assets.gpt2), num_labels=2, rank=rank, alpha=8.0, dropout=0.0)
    local = LocalTraining(lr=0.2, steps=2, epochs=None, batch_size=8)
    algorithm = algorithm or Recording()
    algorithm.watch = model
    return FederatedModule(model=model, algorithm=algorithm, local=local, lora_aggregation=aggregation, execution=execution, **kw)


def effective(m):
    """Per adapted layer: the weight the model computes with, W0 + s (B A)^T (GPT-2's Conv1D layout)."""
    named = dict(m.model.named_parameters())
    return {l.base: named[l.base].detach() + l.scaling * (named[l.b] @ named[l.a]).detach().T for l in m.model.lora_layers()}


def client_mean(m, x, deltas, weights, clients=None):
    """s sum_i w_i (B_i A_i)^T from the recorded round: the clients' own factors, each at its rank
    (``clients``: their ids, where the method has ranks)."""
    w = weights.double() / weights.double().sum()
    ranks = [m.lora.client_rank(c) for c in clients] if clients is not None else [None] * len(deltas)
    return {
        l.b: sum(float(wi) * l.scaling * ((x[l.b] + d[l.b])[:, :r] @ (x[l.a] + d[l.a])[:r]).T for d, wi, r in zip(deltas, w, ranks))
        for l in m.model.lora_layers()
    }


@pytest.mark.parametrize("name,compressed,ranks", [
    ("stacked", False, None), ("exact_residual", False, None), ("exact_residual", True, None),
    ("stacked", False, [1, 2, 4]), ("exact_residual", False, [1, 2, 4]),
])  # fmt: skip
def test_flora_and_fedex_make_the_round_the_mean_of_the_clients_updates(assets, tmp_path, name, compressed, ranks):
    """Also with uplink compression (Int8 + error feedback: the mean of the factors the server reconstructs) and
    with clients of ranks 1, 2, 4 (each client's product at its own rank)."""
    from fl_lightning.compression import Int8
    from fl_lightning.compression.stages import Compression
    from fl_lightning.lora import METHODS

    method = METHODS[name](ranks=ranks)
    m = module(assets, method, compression=Compression(up=Int8()) if compressed else None)
    before = {l.base: dict(m.model.named_parameters())[l.base].detach().clone() for l in m.model.lora_layers()}
    tiny_trainer(tmp_path, rounds=2).fit(m, datamodule=sst2(assets, num_clients=4, per_round=3))
    x, deltas, weights, w0 = m.algorithm.last
    named = dict(m.model.named_parameters())
    want, got = client_mean(m, x, deltas, weights, m.algorithm.clients if ranks else None), effective(m)
    for l in m.model.lora_layers():  # W0 + s (B' A')^T after the round = W0 + s sum_i w_i (B_i A_i)^T, W0 of the round's start
        assert torch.allclose(got[l.base], w0[l.base] + want[l.b], atol=1e-6), name
    if name == "stacked":
        assert all(float(named[l.b].abs().max()) == 0.0 for l in m.model.lora_layers())  # adapters restart each round
    assert any(not torch.equal(before[k], named[k]) for k in before)


def test_factors_is_fedit_bitwise(assets, tmp_path):
    runs = []
    for aggregation in (None, "factors"):
        m = module(assets, aggregation)
        tiny_trainer(tmp_path / str(aggregation), rounds=2).fit(m, datamodule=sst2(assets, num_clients=4, per_round=2))
        runs.append(m)
    for (name, a), b in zip(runs[0].model.named_parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b), name


def test_svd_sets_the_best_rank_r_approximation_of_the_mean_update(assets, tmp_path):
    m = module(assets, "svd", rank=2)
    tiny_trainer(tmp_path, rounds=1).fit(m, datamodule=sst2(assets, num_clients=4, per_round=3))
    x, deltas, weights, w0 = m.algorithm.last
    want, got, named = client_mean(m, x, deltas, weights), effective(m), dict(m.model.named_parameters())
    for l in m.model.lora_layers():
        assert torch.equal(named[l.base].detach(), w0[l.base])  # nothing folded
        target = want[l.b].double()
        u, s, vh = torch.linalg.svd(target)
        best = (u[:, :2] * s[:2]) @ vh[:2]
        assert torch.allclose((got[l.base] - w0[l.base]).double(), best, atol=1e-5)


@pytest.mark.parametrize("name", ["zero_pad", "factors", "svd"])
def test_heterogeneous_ranks_batched_equals_sequential_and_padding_stays_zero(assets, tmp_path, name):
    """Clients of ranks 1, 2, 4 (client c: ranks[c % 3]) in one stacked pass over the shared base equal
    one-after-another training; a rank-r_i client's factors and Adam state beyond r_i stay exactly zero."""
    runs = {}
    for execution in ("sequential", "batched"):
        method = {"zero_pad": ZeroPad, "factors": Factors, "svd": SVD}[name](ranks=[1, 2, 4])
        m = module(assets, method, algorithm=LocalAdam(global_lr=1.0), execution=execution)
        # float64: Adam's eps regime turns float32 rounding (which differs by CPU between the two programs)
        # into ~1e-3 differences; in float64 the two executions agree to ~1e-11
        trainer = tiny_trainer(tmp_path / execution, rounds=2, precision="64-true")
        trainer.fit(m, datamodule=sst2(assets, num_clients=3, per_round=3))
        runs[execution] = m
    for (key, a), b in zip(runs["sequential"].model.named_parameters(), runs["batched"].model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), key
    m = runs["batched"]
    assert m.executor.inner._per_client_x  # the round ran stacked, each client with its own zero-padded x
    for layer in m.model.lora_layers():
        v = m.store.get(0, dict)["v"]  # client 0 trains at rank 1: zero gradient beyond it
        assert float(v[layer.a][1:].abs().max()) == 0.0 and float(v[layer.b][:, 1:].abs().max()) == 0.0
        assert float(v[layer.a][:1].abs().max()) > 0.0


def test_client_level_dp_is_refused_where_the_method_reads_unnoised_factors(assets):
    from fl_lightning.pipeline.privacy import ClientPrivacy

    with pytest.raises(ValueError, match=r"model.lora_aggregation=exact_residual with client-level DP \(model.privacy\)"):
        module(assets, "exact_residual", privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0))
    module(assets, "factors", privacy=ClientPrivacy(clip_norm=1.0, noise_multiplier=1.0))  # a guarantee: accepted


@pytest.mark.parametrize("name", ["stacked", "svd"])
def test_exported_adapter_of_every_method_loads_with_the_peft_auto_class_and_gives_the_framework_outputs(assets, tmp_path, name):
    """A folding method (FLoRA) exports its folded base beside the adapter and names it in adapter_config.json."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoConfig, AutoTokenizer

    from fl_lightning.run.export import ExportPretrained

    m, export = module(assets, name), tmp_path / "adapter"
    tiny_trainer(tmp_path, rounds=2, callbacks=[ExportPretrained(str(export))]).fit(m, datamodule=sst2(assets))
    assert (export / "base").is_dir() == (name == "stacked")
    config, tokenizer = AutoConfig.from_pretrained(str(export)), AutoTokenizer.from_pretrained(str(export))
    loaded = AutoPeftModelForSequenceClassification.from_pretrained(str(export), num_labels=2, pad_token_id=config.pad_token_id).eval()
    batch = tokenizer(["a fine film", "the plot was dull and far too long"], padding=True, return_tensors="pt")
    m.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, m.model(**batch), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["stacked", "exact_residual"])
def test_resume_of_a_folding_method_is_bitwise(assets, tmp_path, name):
    """The folded frozen weights are in the checkpoint, and FLoRA's fresh A comes from (seed, round)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(directory, rounds, ckpt_path=None):
        m = module(assets, name)
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        trainer = tiny_trainer(directory, rounds=rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(m, datamodule=sst2(assets, per_round=2), ckpt_path=ckpt_path)
        return m

    straight = run(tmp_path / "a", rounds=3)
    run(tmp_path / "b", rounds=2)
    resumed = run(tmp_path / "c", rounds=3, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for (key, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), key
    if name == "stacked":  # a resume with another method is refused, naming both
        from fl_lightning.core.errors import CheckpointError

        m = module(assets, "svd")
        with pytest.raises(CheckpointError, match="model.lora_aggregation: stacked in the checkpoint, svd in this run"):
            tiny_trainer(tmp_path / "d", rounds=3).fit(m, datamodule=sst2(assets, per_round=2), ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))


def test_share_a_keeps_b_with_each_client_and_needs_it_personal(assets, tmp_path):
    from fl_lightning.algorithms import FedAvgP

    with pytest.raises(ValueError, match=r"model.lora_aggregation=share_a keeps each client's B: set model.personal"):
        module(assets, "share_a")
    with pytest.raises(ValueError, match="model.lora_aggregation=exact_residual aggregates B, but model.personal holds it"):
        module(assets, "exact_residual", algorithm=FedAvgP(), personal=["*lora_B*"])
    m = module(assets, "share_a", algorithm=FedAvgP(), personal=["*lora_B*"])
    start = {l.b: dict(m.model.named_parameters())[l.b].detach().clone() for l in m.model.lora_layers()}
    tiny_trainer(tmp_path, rounds=2).fit(m, datamodule=sst2(assets, num_clients=4, per_round=2))
    assert all(l.a in m.federated_names and l.b not in m.federated_names for l in m.model.lora_layers())
    kept = [m.client_personal(c) for c in range(4) if m.store.get(c, dict)]
    assert len(kept) >= 2 and any(not torch.equal(kept[0][l.b], start[l.b]) for l in m.model.lora_layers())
    assert any(not torch.equal(kept[0][l.b], kept[1][l.b]) for l in m.model.lora_layers())  # each client its own B


@pytest.mark.parametrize("rule", ["FAdamGT", "SCAFFOLD"])
def test_tracking_and_control_variates_stay_zero_beyond_a_clients_rank(assets, tmp_path, rule):
    """Every x-shaped broadcast entry (FAdamGT's y, SCAFFOLD's c) is zero-padded too, so a rank-1 client's state
    beyond rank 1 stays exactly zero (docs/algorithms.md 28.7), and batched equals sequential."""
    from fl_lightning.algorithms import SCAFFOLD, FAdamGT

    runs = {}
    for execution in ("sequential", "batched"):
        algorithm = FAdamGT(global_lr=1.0, tracking=1.0) if rule == "FAdamGT" else SCAFFOLD()
        m = module(assets, Factors(ranks=[1, 2, 4]), algorithm=algorithm, execution=execution)
        # float64: Adam's eps regime turns float32 rounding (which differs by CPU between the two programs)
        # into ~1e-3 differences; in float64 the two executions agree to ~1e-11
        trainer = tiny_trainer(tmp_path / execution, rounds=3, precision="64-true")
        trainer.fit(m, datamodule=sst2(assets, num_clients=3, per_round=3))
        runs[execution] = m
    for (key, a), b in zip(runs["sequential"].model.named_parameters(), runs["batched"].model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), key
    m = runs["batched"]
    state = m.store.get(0, dict)["y" if rule == "FAdamGT" else "c"]
    for layer in m.model.lora_layers():
        assert float(state[layer.a][1:].abs().max()) == 0.0 and float(state[layer.b][:, 1:].abs().max()) == 0.0
        assert float(state[layer.a][:1].abs().max()) > 0.0
