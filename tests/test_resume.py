"""Resume: 6 rounds straight == 3 rounds + checkpoint + resume to 6, bit for bit."""

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning import FedAvg, LocalTraining
from fl_lightning.core import params as P
from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer


class StatefulFedAvg(FedAvg):
    """FedAvg plus client state, server state and a stateful server optimizer, to exercise every store."""

    def client_state_init(self, x):
        return {"last_delta": P.zeros_like(x), "visits": {"n": torch.zeros(())}}

    def server_state_init(self, x):
        return {"sum_pseudo_grad": P.zeros_like(x)}

    def client_finish(self, params, local, ctx):
        upload, _ = super().client_finish(params, local, ctx)
        visits = {"n": ctx.client_state["visits"]["n"] + 1}
        return upload, {"last_delta": upload["delta"], "visits": visits}

    def aggregate(self, x, uploads, weights, server_state, info, local_steps):
        pseudo_grad, _ = super().aggregate(x, uploads, weights, server_state, info, local_steps)
        return pseudo_grad, {"sum_pseudo_grad": P.add(server_state["sum_pseudo_grad"], pseudo_grad)}

    def server_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.global_lr, momentum=0.9)


def _run(tmp_path, rounds, ckpt_path=None):
    module = tiny_module(StatefulFedAvg(global_lr=0.5), LocalTraining(lr=0.1, steps=3, batch_size=8, lr_decay=0.9))
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = tiny_trainer(tmp_path, rounds, enable_checkpointing=True, callbacks=[checkpoint])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8, clients_per_round=3), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_is_bitwise_identical(tmp_path):
    straight, _ = _run(tmp_path / "a", rounds=6)
    _, first_half = _run(tmp_path / "b", rounds=3)
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3
    resumed, trainer = _run(tmp_path / "c", rounds=6, ckpt_path=str(last))

    assert trainer.global_step == 6
    # Rounds 0-2 and 3-5 differ in clients and lr, so replaying rounds 0-2 after the resume would break equality.
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert len(straight.store) > 0 and straight.store.equal(resumed.store)
    for name in straight.server_state["sum_pseudo_grad"]:
        assert torch.equal(straight.server_state["sum_pseudo_grad"][name], resumed.server_state["sum_pseudo_grad"][name])
    assert straight.comm_totals == resumed.comm_totals

