"""Clients as rows of one batch (fl_lightning/core/client_rows.py): every layer rule gives each client
exactly what its own model gives on its own batch, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.core.client_rows import ClientRows, model_declares
from fl_lightning.core.objective import Objective
from models import MLP, ResNet18


class TinyConvNet(nn.Module):
    """Every rule: Conv2d (with and without bias, strided), GroupNorm, Linear."""

    independent_rows = True

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.norm(self.conv1(x)))
        return self.head(torch.relu(self.conv2(x)).flatten(1))


def _stacked(model, names, clients):
    torch.manual_seed(1)
    named = dict(model.named_parameters())
    return {n: named[n].detach() + 0.1 * torch.randn(clients, *named[n].shape) for n in names}


@pytest.mark.parametrize("substituted", ["all", "biases_only", "weights_only"])
def test_client_rows_equal_each_clients_own_forward_and_gradient(substituted):
    torch.manual_seed(0)
    model = TinyConvNet()
    names = [n for n, _ in model.named_parameters()]
    if substituted == "biases_only":
        names = [n for n in names if n.endswith("bias")]
    elif substituted == "weights_only":
        names = [n for n in names if n.endswith("weight")]
    objective = Objective(model, names)
    assert objective.rows is not None
    clients, batch = 3, 4
    params = _stacked(model, names, clients)
    x, y = torch.randn(clients, batch, 3, 8, 8), torch.randint(0, 5, (clients, batch))

    losses, grads = objective.grad_fn((x, y), 0.0, stacked=True)(params)
    for i in range(clients):
        own = {n: p[i] for n, p in params.items()}
        loss, grad = objective.grad_fn((x[i], y[i]), 0.0)(own)
        torch.testing.assert_close(losses[i], loss, rtol=1e-5, atol=1e-6)
        for n in names:
            torch.testing.assert_close(grads[n][i], grad[n], rtol=1e-4, atol=1e-6, msg=n)


def test_rows_and_vmap_agree_on_the_mlp():
    torch.manual_seed(0)
    model = MLP(6, 3, hidden=[8])
    names = [n for n, _ in model.named_parameters()]
    rows, vmapped = Objective(model, names), Objective(model, names)
    vmapped.rows = None
    params = _stacked(model, names, 4)
    batch = (torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5)))
    (a, _, _), (b, _, _) = rows.stacked(params, batch), vmapped.stacked(params, batch)
    torch.testing.assert_close(a, b)


def test_the_declaration_belongs_to_the_class_with_the_forward_or_to_the_instance():
    class OwnForward(MLP):
        def forward(self, x):
            return super().forward(x) * 2

    assert model_declares(MLP(4, 2), "independent_rows")
    assert not model_declares(OwnForward(4, 2), "independent_rows")
    assert model_declares(ResNet18(num_classes=2, norm="group"), "independent_rows")
    assert not model_declares(ResNet18(num_classes=2, norm="batch_nostats"), "independent_rows")  # batch statistics mix rows


def test_a_tensor_outside_the_rules_leaves_stacking_to_vmap():
    class WithEmbedding(nn.Module):
        independent_rows = True

        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, tokens):
            return self.head(self.embed(tokens).mean(1))

    model = WithEmbedding()
    names = [n for n, _ in model.named_parameters()]
    assert Objective(model, names).rows is None
    assert Objective(model, ["head.weight", "head.bias"]).rows is not None
    with pytest.raises(Exception, match="embed.weight"):
        ClientRows(model, names)


def test_a_declared_model_whose_output_carries_a_penalty_falls_back_to_vmap_and_keeps_it():
    """Client rows give plain logits only: an output with ``.penalty`` switches the objective to vmap,
    which adds every client's own penalty (here a function of its own weights)."""

    class Penalised(nn.Module):
        independent_rows = True

        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            out = type("Out", (), {})()
            out.logits, out.penalty = self.head(x), self.head.weight.square().sum()
            return out

    torch.manual_seed(0)
    model = Penalised()
    names = [n for n, _ in model.named_parameters()]
    objective = Objective(model, names)
    assert objective.rows is not None
    params = _stacked(model, names, 3)
    batch = (torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5)))
    losses, _, _ = objective.stacked(params, batch)
    assert objective._plain_outputs is False  # the switch is remembered
    for i in range(3):
        own = {n: p[i] for n, p in params.items()}
        torch.testing.assert_close(losses[i], objective.at(own, (batch[0][i], batch[1][i]))[0])
