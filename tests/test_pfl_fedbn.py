"""FedBN (Li et al., ICLR 2021) = FedSim with the normalization layers' affine parameters personal
(docs/algorithms.md, 25.7), on SmallCNN's optional norm layers: configs/pfl_fedbn_digits.yaml against an
independent FedBN; SmallCNN's norm argument (default unchanged, the rows declaration)."""

import pytest
import torch
from torch import nn

from fl_lightning import FedAvg
from fl_lightning.algorithms import FedSim
from fl_lightning.commands.cli import build_cli
from fl_lightning.core.client_rows import model_declares
from models import SmallCNN
from tests.pfl_reference import (
    ROOT, assert_personal_metrics, batched_equals_sequential, cnn, compare_partial, fit, fit_config, max_difference,
    record_uploads, shared_params,
)  # fmt: skip

NORM = ["*norm*"]
NORM_NAMES = ["features.norm0.weight", "features.norm0.bias", "features.norm2.weight", "features.norm2.bias"]


def test_the_config_keeps_the_batch_norm_affine_parameters_personal():
    cli = build_cli(["--config", str(ROOT / "configs" / "pfl_fedbn_digits.yaml")], run=False)
    assert type(cli.model.algorithm) is FedSim and cli.model.personal_names == NORM_NAMES
    norms = [m for m in cli.model.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 2 and all(not m.track_running_stats and m.running_mean is None for m in norms)  # no buffers


@pytest.mark.parametrize("norm", ["batch_nostats", "group"])
def test_fedbn_equals_an_independent_reference(norm):
    differences = compare_partial(FedSim(), NORM, model_fn=lambda: cnn(norm=norm))
    print(f"FedBN ({norm}) vs reference:", differences)
    assert max(v for k, v in differences.items() if k != "personal_moved") < 1e-6
    assert differences["personal_moved"] > 1e-4  # the norm layers' affine parameters moved per client


def test_the_norm_layers_never_leave_the_client():
    algorithm = FedSim()
    uploads = record_uploads(algorithm)
    module = fit(algorithm, NORM, model_fn=lambda: cnn(norm="batch_nostats"))
    assert uploads and all(set(u["delta"]) == set(module.federated_names) for u in uploads)
    assert not any("norm" in k for u in uploads for k in u["delta"]) and len(module.federated_names) == 8


def test_batched_execution_stacks_the_clients_and_equals_sequential_execution():
    batched_equals_sequential(FedSim, NORM, model_fn=lambda: cnn(norm="batch_nostats"))


# ---- SmallCNN's norm argument ------------------------------------------------------------------------
class OriginalSmallCNN(nn.Module):
    """SmallCNN as it was before its norm argument, written out."""

    def __init__(self, channels=4, hidden=16):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, 2 * channels, 3, padding=1),
                                      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(2 * channels * 16, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def test_the_default_norm_is_the_network_as_it_was_bit_for_bit():
    torch.manual_seed(0)
    original = OriginalSmallCNN()
    new = cnn()
    assert list(new.state_dict()) == list(original.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), original.state_dict().values()))
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(new(x), original(x)) and model_declares(new, "independent_rows")


def test_batch_statistics_mix_rows_so_the_model_does_not_claim_independent_rows():
    x = torch.randn(6, 1, 8, 8)
    for norm, independent in (("none", True), ("group", True), ("batch_nostats", False)):
        model = cnn(norm=norm).eval()
        assert model_declares(model, "independent_rows") is independent, norm
        alone = model(x[:3])
        together = model(x)[:3]
        assert torch.allclose(alone, together, atol=1e-6) is independent, norm  # batch statistics: the other rows matter
        assert torch.equal(model(x), model.head(model.representation(x)))


@pytest.mark.parametrize("norm", ["group", "batch_nostats"])
def test_fedavg_with_norm_layers_batched_equals_sequential(norm):
    """Without personal tensors the clients run stacked: GroupNorm as client rows, BatchNorm by vmap of the forward."""
    seq, bat = fit(FedAvg(), model_fn=lambda: cnn(norm=norm)), fit(FedAvg(), execution="batched", model_fn=lambda: cnn(norm=norm))
    assert not bat.executor.inner.fallbacks
    assert (bat.objective.rows is not None) is (norm == "group")
    assert max_difference(shared_params(seq), shared_params(bat)) < 1e-5


def test_bad_norm_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="SmallCNN norm must be 'none', 'group' or 'batch_nostats', got 'batch'"):
        SmallCNN(norm="batch")
    with pytest.raises(ValueError, match="needs an even number of channels, got 3"):
        SmallCNN(channels=3, norm="group")


def test_the_config_fits_through_the_cli_and_logs_personal_and_unseen_accuracy(tmp_path, monkeypatch):
    cli, rows = fit_config(tmp_path, monkeypatch, "pfl_fedbn_digits")
    assert cli.trainer.global_step == 3 and cli.model.personal_names == NORM_NAMES
    assert_personal_metrics(rows)
