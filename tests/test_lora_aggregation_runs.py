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


def client_mean(m, x, deltas, weights, ranks=None):
    """W0 + s sum_i w_i (B_i A_i)^T from the recorded round (the clients' own factors, each at its rank)."""
    named, w = dict(m.model.named_parameters()), weights.double() / weights.double().sum()
    return {
        l.b: sum(float(wi) * l.scaling * ((x[l.b] + d[l.b]) @ (x[l.a] + d[l.a])).T for d, wi in zip(deltas, w))
        for l in m.model.lora_layers()
    }


@pytest.mark.parametrize("name", ["stacked", "exact_residual"])
def test_flora_and_fedex_make_the_round_the_mean_of_the_clients_updates(assets, tmp_path, name):
    m = module(assets, name)
    before = {l.base: dict(m.model.named_parameters())[l.base].detach().clone() for l in m.model.lora_layers()}
    tiny_trainer(tmp_path, rounds=2).fit(m, datamodule=sst2(assets, num_clients=4, per_round=3))
    x, deltas, weights, w0 = m.algorithm.last
    named = dict(m.model.named_parameters())
    want, got = client_mean(m, x, deltas, weights), effective(m)
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
