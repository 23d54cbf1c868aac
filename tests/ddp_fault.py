"""A 2-process DDP fit (gloo, CPU) where a client on one rank raises a fatal (non-client-fault) error
in round 1; run by tests/test_distributed.py, which checks that both processes stop (no hang).

    python tests/ddp_fault.py --fail-rank 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from datamodules import IID, FederatedDataModule  # noqa: E402
from fl_lightning import FederatedModule, LocalTraining, UniformSampling  # noqa: E402
from fl_lightning.algorithms import FedAvg  # noqa: E402
from fl_lightning.core.errors import interrupted  # noqa: E402
from models import MLP  # noqa: E402


class FailsOnOneRank(FedAvg):
    """FedAvg whose clients on rank ``fail_rank`` raise a RuntimeError in round 1 (an error that would recur)."""

    def __init__(self, fail_rank: int, interrupt: bool = False) -> None:
        super().__init__()
        self.fail_rank, self.interrupt = fail_rank, interrupt

    def client_step(self, params, local, ctx):
        if ctx.info.round == 1 and dist.is_initialized() and dist.get_rank() == self.fail_rank:
            if self.interrupt:  # as if only this rank had seen SIGTERM so far
                raise interrupted(ctx.info.round, 0, ctx.step, ctx.num_steps)
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (a setup error on this rank)")
        return super().client_step(params, local, ctx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--interrupt", action="store_true", help="the rank stops as on SIGTERM instead of failing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = FederatedModule(MLP(8, 3, hidden=[16]), FailsOnOneRank(args.fail_rank, args.interrupt), LocalTraining(lr=0.05, steps=2, batch_size=8))
    data = FederatedDataModule(
        "synthetic", dict(num_samples=400, num_features=8, num_classes=3, seed=0), num_clients=10,
        partition=IID(), participation=UniformSampling(4),
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
