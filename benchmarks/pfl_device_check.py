"""Every personalized-FL method of docs/personalization.md on one device: rounds per second and the
protocol's numbers (global test accuracy, personalized mean and worst 10%, unseen clients).

Runs the configs' settings through the Python API (no CLI), so it needs only torch, lightning and
scikit-learn (the digits data) on the machine:

    python benchmarks/pfl_device_check.py --device cuda --rounds 30 --out pfl_cuda.json
    python benchmarks/pfl_device_check.py --device cpu --rounds 30 --out pfl_cpu.json

``--model resnet18`` trains ResNet18 (GroupNorm) on synthetic CIFAR-shaped data (3x32x32, 10 classes,
label-skewed like the digits study) instead: a speed check of the methods at vision scale, not an accuracy study.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import fl_lightning  # noqa: E402,F401
from fl_lightning import FederatedModule, LocalTraining, UniformSampling  # noqa: E402
from fl_lightning import algorithms as A  # noqa: E402
from fl_lightning.datamodules import Dirichlet, FederatedDataModule  # noqa: E402
from fl_lightning.models import ResNet18, SmallCNN  # noqa: E402

# name -> (algorithm factory, personal patterns, model keyword arguments, local overrides): configs/pfl_*_digits.yaml
METHODS = {
    "FedAvg": (lambda: A.FedAvg(), None, {}, {}),
    "Ditto": (lambda: A.Ditto(lam=0.1), None, {}, {}),
    "pFedMe": (lambda: A.PFedMe(lam=15.0, inner_steps=5), None, {}, {"personal_lr": 0.05}),
    "APFL": (lambda: A.APFL(alpha=0.5, adaptive_alpha=True), None, {}, {}),
    "Per-FedAvg FO": (lambda: A.PerFedAvg(alpha=0.01, variant="fo"), None, {}, {}),
    "Per-FedAvg HF": (lambda: A.PerFedAvg(alpha=0.01, variant="hf"), None, {}, {}),
    "FedProto": (lambda: A.FedProto(lam=1.0), None, {}, {}),
    "FedALA": (lambda: A.FedALA(layer_idx=2, eta=1.0, ala_steps=5), None, {}, {}),
    "FedPer": (lambda: A.FedSim(), ["classifier.2"], {}, {}),
    "FedRep": (lambda: A.FedAlt(personal_steps=5), ["classifier.2"], {}, {}),
    "LG-FedAvg": (lambda: A.FedSim(), ["features", "classifier.0"], {}, {}),
    "FedBN": (lambda: A.FedSim(), ["*norm*"], {"norm": "batch_nostats"}, {}),
    "FedBABU": (lambda: A.FedBABU(head=["classifier.2"], finetune="all", finetune_steps=5), None, {}, {}),
    "FedRoD": (lambda: A.FedRoD(head=["classifier.2"]), None, {}, {}),
}
RESNET_PERSONAL = {"FedPer": ["fc"], "FedRep": ["fc"], "LG-FedAvg": None, "FedBN": None}  # LG/FedBN: digits CNN only
RESNET_HEAD = {"FedBABU": ["fc"], "FedRoD": ["fc"]}


def _data(model: str, seed: int) -> FederatedDataModule:
    common = dict(num_clients=20, partition=Dirichlet(0.1, min_size=20), participation=UniformSampling(5), holdout_fraction=0.2,
                  new_client_fraction=0.2, val_fraction=0.1, seed=seed)  # fmt: skip
    if model == "smallcnn":
        return FederatedDataModule(dataset="digits", **common)
    args = {"num_samples": 6000, "num_features": 3 * 32 * 32, "num_classes": 10, "seed": seed}
    return FederatedDataModule(dataset="synthetic", dataset_args=args, **common)


class _Images(torch.nn.Module):
    """ResNet18 fed flat synthetic rows reshaped to 3x32x32 (forward, representation and head)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = ResNet18(num_classes=10)
        self.independent_rows = getattr(self.net, "independent_rows", False)

    def forward(self, x):
        return self.net(x.view(-1, 3, 32, 32))

    def representation(self, x):
        return self.net.representation(x.view(-1, 3, 32, 32))

    def head(self, z):
        return self.net.head(z)


def run(name: str, model: str, device: str, rounds: int, seed: int) -> dict:
    make, personal, model_kw, local_kw = METHODS[name]
    torch.manual_seed(seed)
    if model == "smallcnn":
        net = SmallCNN(in_channels=1, num_classes=10, image_size=8, **model_kw)
    else:
        if name in RESNET_PERSONAL and RESNET_PERSONAL[name] is None:
            return {"skipped": "its personal layers are named for the digits CNN"}
        personal = RESNET_PERSONAL.get(name, personal)
        personal = [f"net.{p}" for p in personal] if personal else None
        net = _Images()
    algorithm = make()
    if model != "smallcnn" and name in RESNET_HEAD:
        algorithm.head = ["net.fc"]
    local = LocalTraining(lr=0.05, steps=10, batch_size=20, **local_kw)
    module = FederatedModule(net, algorithm, local, personal=personal, execution="batched")
    data = _data(model, seed)
    trainer = L.Trainer(max_steps=rounds, val_check_interval=rounds, check_val_every_n_epoch=None, accelerator=device, devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)  # fmt: skip
    started = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - started
    trainer.test(module, datamodule=data, verbose=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    fallbacks = dict(getattr(module.executor, "fallbacks", {}) or getattr(module.executor.inner, "fallbacks", {}))
    return {"fit_seconds": seconds, "rounds_per_second": rounds / seconds, "fallbacks": fallbacks, **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=["smallcnn", "resnet18"], default="smallcnn")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    machine = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    results = {"device": machine, "torch": torch.__version__, "model": args.model, "rounds": args.rounds, "seed": args.seed, "runs": {}}
    for name in args.methods.split(","):
        try:
            results["runs"][name] = run(name, args.model, accelerator, args.rounds, args.seed)
        except Exception as error:  # a check: record the failure, go on with the next method
            results["runs"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        row = results["runs"][name]
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
