"""The testing helper checks personalized methods: ``one_round`` with personal tensors, gamma_v and a data pass
(hand-worked), ``check_batched`` with personal tensors."""

from __future__ import annotations

import torch

from fl_lightning.algorithms import FedProto, FedSim
from fl_lightning.algorithms.base import DataPass
from fl_lightning.core.tasks import PERSONAL
from fl_lightning.experiments.testing import check_batched, one_round


def test_one_round_trains_personal_tensors_with_their_own_step_size():
    """FedSim, 2 steps of gradient 1 on u (shared) and v (personal): u moves by 2 lr, v by 2 gamma_v; v is kept, not sent."""
    x, own = {"u": torch.tensor([1.0])}, [{"v": torch.tensor([2.0])}, {"v": torch.tensor([-1.0])}]
    ones = {"u": torch.tensor([1.0]), "v": torch.tensor([1.0])}
    out = one_round(FedSim(), x, [[ones, ones], [ones, ones]], lr=0.1, personal=own, personal_lr=0.5)
    assert all(set(u["delta"]) == {"u"} and torch.allclose(u["delta"]["u"], torch.tensor([-0.2])) for u in out.uploads)
    assert [float(s[PERSONAL]["v"]) for s in out.client_states] == [1.0, -2.0]
    assert torch.allclose(out.x["u"], torch.tensor([0.8]))


def test_one_round_gives_fedproto_its_data_pass():
    """Client 0's features [[1, 0], [3, 0], [0, 2]] with labels 0, 0, 1: prototypes [2, 0] and [0, 2], counts 2 and 1."""
    features, target = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0, 1])

    def data_pass(params):
        return DataPass(features, torch.zeros(3, 2), target, torch.ones(3))

    x = {"w": torch.zeros(2)}
    out = one_round(FedProto(num_classes=2, feature_dim=2), x, [[{"w": torch.zeros(2)}]], data_pass=[data_pass])
    sent = out.uploads[0]["prototypes"]
    assert torch.equal(sent["value"], torch.tensor([[2.0, 0.0], [0.0, 2.0]])) and torch.equal(sent["count"], torch.tensor([2.0, 1.0]))


def test_check_batched_compares_personal_tensors():
    check = check_batched(FedSim(), personal=["net.3.*"])
    assert check.max_difference <= 1e-5
