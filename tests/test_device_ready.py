"""A round loop ready for accelerators: no host reads in the local steps, client data placed on
the device once, bf16 autocast honoured in client training, channels-last ResNets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from datamodules import FederatedDataModule, IID
from fl_lightning import FedAvg, FederatedModule, LocalTraining, UniformSampling
from fl_lightning.algorithms import SCAFFOLD, FAdamGT, FedMIM, FedProx, FedSAM, LocalAdam
from models import MLP, LoRAClassifier, ResNet18
from tests.conftest import tiny_datamodule, tiny_trainer
from tests.text_fixtures import shared_assets

pytestmark = pytest.mark.filterwarnings("ignore")

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


@pytest.fixture
def host_reads(monkeypatch):
    """Count every Python-level read of a tensor's value on the host (the calls that sync a device)."""
    counts = {"n": 0}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts


def _reads_per_fit(host_reads, build, steps: int, execution: str) -> int:
    module, data = build(steps, execution)
    trainer = tiny_trainer(f"/tmp/fl-device-ready-{execution}-{steps}", rounds=3)
    before = host_reads["n"]
    trainer.fit(module, datamodule=data)
    assert not getattr(getattr(module.executor, "inner", module.executor), "fallbacks", None)
    return host_reads["n"] - before


def _mlp(algorithm_fn):
    def build(steps, execution):
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), algorithm_fn(), LocalTraining(lr=0.1, steps=steps, batch_size=8),
                                 execution=execution)  # fmt: skip
        return module, tiny_datamodule()

    return build


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("algorithm_fn", [FedAvg, SCAFFOLD, lambda: FedProx(mu=0.1), FedSAM, FedMIM, LocalAdam, FAdamGT],
                         ids=["fedavg", "scaffold", "fedprox", "fedsam", "fedmim", "local_adam", "fadam_gt"])  # fmt: skip
def test_local_steps_never_read_a_tensor_on_the_host(host_reads, execution, algorithm_fn):
    """The host reads of a fit do not grow with the number of local steps: losses, accuracies and
    finiteness are read once per round."""
    build = _mlp(algorithm_fn)
    few, many = _reads_per_fit(host_reads, build, 2, execution), _reads_per_fit(host_reads, build, 6, execution)
    assert many == few, f"{many - few} more host reads for 4 more local steps per client x 3 rounds"


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_lora_local_steps_never_read_a_tensor_on_the_host(host_reads, tmp_path_factory, execution):
    from tests.test_lora import sst2

    assets = shared_assets(tmp_path_factory)

    def build(steps, execution):
        torch.manual_seed(0)
        model = LoRAClassifier(str(assets.gpt2), num_labels=2, rank=2, alpha=4.0, dropout=0.0)
        local = LocalTraining(lr=0.1, steps=steps, batch_size=8)
        return FederatedModule(model, FedAvg(), local, execution=execution), sst2(assets, num_clients=6, per_round=3)

    assert _reads_per_fit(host_reads, build, 2, execution) == _reads_per_fit(host_reads, build, 6, execution)


def test_client_batches_come_from_data_placed_on_the_device_once(tmp_path_factory):
    """After ``place(device)`` every client batch, sequential or stacked, is gathered on that device
    (the meta device stands in for an accelerator: no data is copied per step to get there)."""
    from tests.test_lora import sst2

    meta = torch.device("meta")
    data = FederatedDataModule("digits", num_clients=10, partition=IID(), participation=UniformSampling(4))
    text = sst2(shared_assets(tmp_path_factory), num_clients=6, per_round=3)
    for dm in (data, text):
        dm.setup()
        dm.place(meta)
        batches = [*dm.client_batches(0, 7, 8, 3), *dm.stacked_client_batches([0, 1], [7, 8], 8, 3)]
        tensors = [t for b in batches for t in (b.values() if isinstance(b, dict) else b)]
        assert len(batches) == 6 and all(t.device == meta for t in tensors)
        dm.place(torch.device("cpu"))
        batch = next(dm.client_batches(0, 7, 8, 3))
        assert all(t.device.type == "cpu" for t in (batch.values() if isinstance(batch, dict) else batch))


class _Recording(nn.Module):
    """A linear model that records the dtype its matmul runs in."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 3, bias=False)
        self.dtypes = set()

    def forward(self, x):
        y = self.l(x)
        self.dtypes.add(y.dtype)
        return y


@pytest.mark.parametrize("execution", ["sequential", "batched"])
def test_bf16_mixed_precision_runs_client_training_in_bfloat16(tmp_path, execution):
    def fit(precision):
        torch.manual_seed(0)
        model = _Recording()
        module = FederatedModule(model, FedAvg(), LocalTraining(lr=0.5, steps=3, batch_size=8), execution=execution)
        tiny_trainer(tmp_path / precision, rounds=3, precision=precision).fit(module, datamodule=tiny_datamodule())
        return module

    full, mixed = fit("32-true"), fit("bf16-mixed")
    assert full.model.dtypes == {torch.float32} and mixed.model.dtypes == {torch.bfloat16}
    assert mixed.model.l.weight.dtype == torch.float32  # master weights stay float32
    gap = (full.model.l.weight - mixed.model.l.weight).abs().max()
    assert 1e-5 < gap < 0.1, gap


def test_channels_last_resnet_stores_nhwc_and_computes_the_same():
    torch.manual_seed(0)
    plain = ResNet18(num_classes=4, norm="group")
    torch.manual_seed(0)
    nhwc = ResNet18(num_classes=4, norm="group", channels_last=True)
    assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(nhwc(x), plain(x), rtol=1e-4, atol=1e-5)
