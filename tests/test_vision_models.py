"""Vision models: parameter counts of the reference architectures, forward/backward, BatchNorm buffers."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fl_lightning.core import params as P
from models import FedAvgCNN, ResNet18, ResNet18x64
from tests.vision_fixture import write_fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _bare_argv(monkeypatch):
    """LightningCLI(args=...) warns when pytest's own argv is also present."""
    monkeypatch.setattr("sys.argv", ["fl-lightning"])


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet18_has_the_cifar_variant_parameter_count_and_trains():
    torch.manual_seed(0)
    model = ResNet18(num_classes=10)
    assert _count(model) == 11_173_962  # the standard CIFAR ResNet-18 (BatchNorm or GroupNorm alike)
    assert _count(ResNet18(num_classes=10, norm="batch")) == 11_173_962
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in model.modules())
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    assert model(x).shape == (2, 10)
    loss = F.cross_entropy(model(x[:, :, :8, :8]), y)  # small input: the pooling is adaptive
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():  # a small gradient step lowers the loss: the gradient is the loss's
        for p in model.parameters():
            p -= 1e-3 * p.grad
        assert F.cross_entropy(model(x[:, :, :8, :8]), y) < loss


def test_resnet18x64_and_fedavg_cnn_shapes_and_counts():
    tiny = ResNet18x64()
    assert tiny(torch.randn(2, 3, 64, 64)).shape == (2, 200)
    assert tiny.conv1.stride == (2, 2) and ResNet18x64(stem_stride=1).conv1.stride == (1, 1)
    cnn = FedAvgCNN(in_channels=1, num_classes=10, image_size=28)
    assert _count(cnn) == 1_663_370  # McMahan et al. 2017
    assert cnn(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    assert FedAvgCNN(3, 10, 32)(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match="num_groups must divide 64"):
        ResNet18(num_groups=3)
    with pytest.raises(ValueError, match="norm must be"):
        ResNet18(norm="layer")


def test_batchnorm_statistics_are_shared_buffers_not_federated():
    """The documented caveat: running stats are not federated and every client's training updates them in place."""
    model = ResNet18(norm="batch")
    names = P.federated_names(model)
    assert not any("running" in n or "num_batches" in n for n in names)
    assert "bn1.weight" in names and "bn1.bias" in names
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = model.bn1.running_mean.clone()
    model.train()
    functional_call(model, params, (torch.randn(4, 3, 32, 32) + 3.0,))  # as a client's local step does
    assert not torch.equal(model.bn1.running_mean, before)
    assert int(model.bn1.num_batches_tracked) == 1
    nostats = ResNet18(norm="batch_nostats")
    assert nostats.bn1.running_mean is None


def test_fedmim_cifar10_config_runs_two_rounds_on_the_local_fixture(tmp_path, monkeypatch):
    from fl_lightning.commands.cli import main

    files = write_fixture(tmp_path, "cifar10", n_train=40, n_test=4)
    data_args = {"data_files": files, "cache_dir": str(tmp_path / "cache")}
    monkeypatch.chdir(tmp_path)
    main([
        "fit", "--config", str(ROOT / "configs" / "fedmim_cifar10.yaml"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.accelerator", "cpu",
        "--trainer.enable_progress_bar", "false",
        "--data.init_args.num_clients", "4", "--data.init_args.participation.init_args.clients_per_round", "2",
        "--data.init_args.partition.init_args.min_size", "2", "--data.init_args.dataset_args", json.dumps(data_args),
        "--model.local.epochs", "1", "--model.local.batch_size", "4",
    ])  # fmt: skip  (the config's own val_fraction: the validation images once crashed the first evaluation as uint8)
    with open(tmp_path / "runs" / "fedmim_cifar10" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert max(float(r["round"]) for r in rows if r["round"]) == 1  # 0-based: rounds 0, 1
    assert [r["val/acc"] for r in rows if r["val/acc"]], "no evaluation logged"
    assert [r["test/acc"] for r in rows if r.get("test/acc")], "no test of the final model"
    losses = [float(r["train/loss"]) for r in rows if r["train/loss"]]
    assert len(losses) == 2 and all(0 < v < 50 for v in losses)


@pytest.mark.parametrize(
    "name,rounds,steps,epochs,alpha,num_classes",
    [
        ("fedmim_cifar10", 1000, None, 5, 0.3, 10),
        ("fedmim_cifar100", 1000, None, 5, 0.1, 100),
        ("fedmim_tinyimagenet", 1000, None, 5, 0.1, 200),
        ("fadam_cifar100", 3000, 3, None, 0.1, 100),
        ("fadam_cifar10", 2000, 3, None, 0.1, 10),
        ("fadam_tinyimagenet", 2000, 3, None, 0.1, 200),
        ("fedavg_mnist", 500, None, 5, None, 10),
    ],
)
def test_vision_configs_hold_the_paper_settings(name, rounds, steps, epochs, alpha, num_classes):
    from datamodules import Dirichlet, VisionDataModule
    from fl_lightning.commands.cli import build_cli

    cli = build_cli(["--config", str(ROOT / "configs" / f"{name}.yaml")], run=False)
    dm, module = cli.datamodule, cli.model
    assert isinstance(dm, VisionDataModule) and dm.num_clients == 100
    assert dm.participation.count(100) == 10
    assert cli.trainer.max_steps == rounds
    assert (module.local.steps, module.local.epochs) == (steps, epochs)
    out = list(module.model.modules())[-1].out_features
    assert out == num_classes
    if alpha is not None:
        assert isinstance(dm.partition, Dirichlet) and dm.partition.alpha == alpha
    if name.startswith("fedmim"):
        assert dm.color is not None and module.local.lr_decay == 0.998 and module.local.weight_decay == 1e-3
        assert module.local.batch_size == 50 and module.local.lr == 0.1


@pytest.mark.parametrize(
    "sweep",
    [
        "fadam_cifar100_sweep",  # the other fadam sweeps differ only in base/target
        "fedmim_cifar10_sweep",
        "fedmim_cifar10_table1_sweep",
        "fedmim_cifar100_table1_sweep",
        "fedmim_tinyimagenet_table1_sweep",
        "fedmim_cifar10_table2_sweep",
        "fedmim_cifar10_table3_sweep",
    ],
)
def test_vision_sweeps_resolve_to_valid_fit_configs(sweep):
    import yaml

    from fl_lightning.commands.cli import build_cli

    spec = yaml.safe_load((ROOT / "configs" / f"{sweep}.yaml").read_text())
    assert (ROOT / spec["base"]).exists() and spec["targets"] and spec["runs"]
    for run in spec["runs"].values():
        args = ["--config", str(ROOT / spec["base"])]
        for key, value in {**spec["overrides"], **run}.items():
            args += [f"--{key}", json.dumps(value) if isinstance(value, (dict, list)) else str(value).lower()]
        cli = build_cli(args, run=False)
        assert not cli.trainer.loggers
        if "model.algorithm" in run:
            assert type(cli.model.algorithm).__name__ == run["model.algorithm"]["class_path"].rsplit(".", 1)[1]
            for name, value in run["model.algorithm"].get("init_args", {}).items():
                stored = getattr(cli.model.algorithm, name, None)  # Adam's beta1/beta2 are stored as `betas`
                if isinstance(stored, (int, float, list)):
                    assert stored == value, (name, value)
        if "model.local.epochs" in run:
            assert cli.model.local.epochs == run["model.local.epochs"]
        if "trainer.max_steps" in spec["overrides"]:
            assert cli.trainer.max_steps == spec["overrides"]["trainer.max_steps"]
        if "model.local.lr" in run:
            assert cli.model.local.lr == run["model.local.lr"]
        if "data.init_args.partition" in run:
            part = run["data.init_args.partition"]
            assert type(cli.datamodule.partition).__name__ == part["class_path"].rsplit(".", 1)[1]
            assert getattr(cli.datamodule.partition, "alpha", None) == part.get("init_args", {}).get("alpha")
