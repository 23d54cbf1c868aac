"""Train with the round's clients split over W processes (Lightning DDP, gloo on CPU) and
save the final global parameters, server state and client store, to compare with a
one-process run.

    python benchmarks/ddp_check.py --devices 2 --out ddp.pt
    python benchmarks/ddp_check.py --devices 1 --out single.pt

``--algorithm scaffold`` has client state (``fedproto``, ``fedala``: a whole model per client; ``fedproto``
uploads class prototypes, summed, and no model delta); ``fedfv`` (tau = 2) and ``fedmgda`` gather every upload,
FedFV's with its loss and the past updates kept in its server state; ``fadam_et`` uploads ``y_delta`` only from
its tracking subset (results of different structure in one round); ``--skew`` gives
clients unequal sizes and one local epoch, so their local steps differ. ``--bernoulli p``
activates each client with probability p (weights 1/(N p), rounds may be empty or leave a
process without clients); ``--dropout f`` drops clients before they train and ``--algorithm fedavg_fail_first``
makes the first client of every round fail while training (either way the survivors are reweighted).
``--privacy C SIGMA`` runs under client-level DP (clip norm C, noise multiplier sigma), with
``--adaptive-clipping`` under adaptive clipping; ``--record-privacy C SIGMA`` under record-level
DP-SGD in local training (Poisson sampling). ``--robust RULE F`` aggregates with a robust rule
(``fl_lightning.robust.Robust``, f attackers): every upload gathered on every process. ``--secagg BITS NOISE``
runs under secure aggregation (clip 1, 4 neighbours, 20 % of the clients dropping after masking; NOISE ``none``,
``gaussian`` or ``skellam`` at noise multiplier 1): every upload gathered, the protocol simulated on every process.
The output also holds the last round's logged metrics and the executor's count of rounds
whose uploads were gathered or summed across the processes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from datamodules import IID, FederatedDataModule, QuantitySkew  # noqa: E402
from fl_lightning import FederatedModule, LocalTraining, UniformSampling  # noqa: E402
from fl_lightning.algorithms import AFL, MOON, QFFL, SCAFFOLD, TERM, Ditto, FAdamET, FedALA, FedAvg, FedFV, FedMGDAPlus, FedProto, PropFair, ScaffoldP  # noqa: E402
from fl_lightning.reliability.faults import ClientFailure, ClientFaults  # noqa: E402
from fl_lightning.core.participation import BernoulliParticipation  # noqa: E402
from fl_lightning.pipeline.privacy import ClientPrivacy  # noqa: E402
from fl_lightning.pipeline.record_privacy import RecordPrivacy  # noqa: E402
from fl_lightning.robust import Robust  # noqa: E402
from fl_lightning.secagg import SecureAggregation  # noqa: E402
from fl_lightning.core.state import flatten_state  # noqa: E402
from models import MLP  # noqa: E402

ALGORITHMS = {"fedavg": FedAvg, "scaffold": SCAFFOLD, "fadam_et": FAdamET, "scaffold_p": ScaffoldP, "moon": MOON, "fedproto": FedProto, "fedala": FedALA, "ditto": Ditto,
              "qffl": QFFL, "term": TERM, "fedfv": functools.partial(FedFV, tau=2), "fedmgda": FedMGDAPlus,
              "afl": AFL, "afl_eg": lambda: AFL(mixture="exponentiated", lambda_lr=1.0), "propfair": PropFair}


class FedAvgFailFirst(FedAvg):
    """FedAvg whose first client of every round fails (found out only when the ranks exchange results)."""

    def client_init(self, params, ctx):
        if ctx.client_id == int(ctx.info.plan.clients[0]):
            raise ClientFailure(f"client {ctx.client_id} fails (--fail-first)")
        return super().client_init(params, ctx)


ALGORITHMS["fedavg_fail_first"] = FedAvgFailFirst
PERSONAL = {"scaffold_p": ["net.3"]}  # a personal head: the warm-up pass and personal client state cross the ranks


def _privacy(args) -> ClientPrivacy | None:
    if not args.privacy:
        return None
    adaptive = dict(adaptive_clipping=True, count_noise=1.0, target_quantile=0.5, clip_lr=0.5) if args.adaptive_clipping else {}
    return ClientPrivacy(*args.privacy, **adaptive)


def _secagg(args) -> SecureAggregation | None:
    if not args.secagg:
        return None
    noise = None if args.secagg[1] == "none" else args.secagg[1]
    return SecureAggregation(int(args.secagg[0]), clip=1.0, neighbours=4, dropout_after_masking=0.2, noise=noise, noise_multiplier=1.0)


def _asynchronous(args) -> dict:
    if args.fedbuff is None:
        return {}
    from fl_lightning.clock import AsyncAggregation, SimClock

    return {"clock": SimClock(speed_sigma=1.0), "asynchronous": AsyncAggregation(concurrency=args.fedbuff[0], buffer_size=args.fedbuff[1])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--execution", default="sequential")
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="fedavg")
    parser.add_argument("--skew", action="store_true", help="unequal client sizes, one local epoch")
    parser.add_argument("--bernoulli", type=float, default=None, help="activation probability (instead of S per round)")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--compress", action="store_true", help="QSGD(4) uploads, random-k 50 %% broadcast changes, error feedback on both")
    parser.add_argument("--privacy", type=float, nargs=2, default=None, metavar=("C", "SIGMA"), help="client-level DP: clip norm, noise multiplier")
    parser.add_argument("--adaptive-clipping", action="store_true", help="with --privacy: adaptive clipping (count noise 1.0, quantile 0.5)")
    parser.add_argument("--record-privacy", type=float, nargs=2, default=None, metavar=("C", "SIGMA"), help="record-level DP-SGD")
    parser.add_argument("--robust", nargs=2, default=None, metavar=("RULE", "F"), help="robust aggregation: rule name, f")
    parser.add_argument("--fedbuff", type=int, nargs=2, default=None, metavar=("C", "B"), help="FedBuff under a simulated clock: concurrency, buffer size")
    parser.add_argument("--secagg", nargs=2, default=None, metavar=("BITS", "NOISE"), help="secure aggregation: bits, none|gaussian|skellam")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    local = LocalTraining(lr=0.05, steps=None, epochs=1, batch_size=16) if args.skew else LocalTraining(lr=0.05, steps=4, batch_size=16)
    personal = PERSONAL.get(args.algorithm)
    compression = None
    if args.compress:
        from fl_lightning.compression import QSGD, Compression, RandomK

        # error feedback on the unbiased QSGD uploads set explicitly (its default is off): the residuals travel too
        compression = Compression(up=QSGD(levels=4), down=RandomK(ratio=0.5), error_feedback_up=True)
    module = FederatedModule(MLP(32, 10, hidden=[64]), ALGORITHMS[args.algorithm](), local, personal=personal, execution=args.execution,
                             faults=ClientFaults(dropout=args.dropout), compression=compression,
                             privacy=_privacy(args),
                             record_privacy=RecordPrivacy(*args.record_privacy) if args.record_privacy else None,
                             robust=Robust(args.robust[0], f=int(args.robust[1])) if args.robust else None,
                             secure_aggregation=_secagg(args),
                             **_asynchronous(args))  # fmt: skip
    participation = BernoulliParticipation(args.bernoulli) if args.bernoulli else UniformSampling(args.clients_per_round)
    data = FederatedDataModule(
        "synthetic", dict(num_samples=8000, num_features=32, num_classes=10, seed=0), num_clients=100,
        partition=QuantitySkew(sigma=1.0) if args.skew else IID(), participation=participation,
    )  # fmt: skip
    strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.rounds, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - start
    if trainer.global_rank == 0:
        torch.save({"params": [p.detach() for p in module.model.parameters()], "seconds": seconds,
                    "server_state": flatten_state(module.server_state), "store": module.store.state_dict(),
                    "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                    "exchanges": dict(module.executor.rounds)}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
