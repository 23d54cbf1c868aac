"""Bitwise check of a refactor: fit configs for a few rounds, dump every tensor of the final state,
and compare two dumps.

    # in a checkout of the old revision, then of the new one:
    python scripts/state_snapshot.py dump OUT_DIR configs/*_digits.yaml configs/quickstart.yaml [--rounds 12]
    python scripts/state_snapshot.py compare OLD_DIR NEW_DIR

A dump holds, per config: the model's state dict, every client's stored state (personal tensors
included), the server state, the server optimizer's state and the final ``val/acc``. Personal
tensors of checkpoints from before they became client state (``personal/<client>/v/<name>``) are
compared as ``client/<client>/personal/<name>``. ``compare`` exits 1 if any tensor differs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch


def dump(out: Path, configs: list[str], rounds: int) -> None:
    from fl_lightning.commands.cli import build_cli

    warnings.filterwarnings("ignore")
    out.mkdir(parents=True, exist_ok=True)
    for config in configs:
        args = ["--config", str(Path(config).resolve()), "--trainer.max_steps", str(rounds), "--trainer.logger", "false",
                "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
                "--trainer.enable_progress_bar", "false", "--trainer.val_check_interval", str(rounds // 2 or 1)]  # fmt: skip
        here = os.getcwd()
        with tempfile.TemporaryDirectory() as run_dir:
            os.chdir(run_dir)
            try:
                cli = build_cli(args, run=False)
                cli.trainer.fit(cli.model, datamodule=cli.datamodule)
            finally:
                os.chdir(here)
        module = cli.model
        state = {f"model/{k}": v for k, v in module.model.state_dict().items()}
        state.update({f"client/{k}": v for k, v in module.store.state_dict().items()})
        state.update({f"server/{n}/{k}": v for n, td in (module.server_state or {}).items() for k, v in td.items()})
        legacy = getattr(module, "personal_store", None)
        if legacy is not None:
            state.update({f"personal/{k}": v for k, v in legacy.state_dict().items()})
        for i, param_state in cli.trainer.optimizers[0].state_dict()["state"].items():
            state.update({f"optimizer/{i}/{k}": v for k, v in param_state.items() if torch.is_tensor(v)})
        state["metric/val_acc"] = torch.tensor(float(cli.trainer.callback_metrics.get("val/acc", float("nan"))))
        torch.save(state, out / f"{Path(config).stem}.pt")
        print(f"{Path(config).stem}: {len(state)} tensors", flush=True)


def _normalised(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        legacy = re.match(r"personal/(\d+)/v/(.+)", key)
        out[f"client/{legacy.group(1)}/personal/{legacy.group(2)}" if legacy else key] = value
    return out


def compare(old: Path, new: Path) -> int:
    differing = 0
    for path in sorted(old.glob("*.pt")):
        a, b = _normalised(torch.load(path)), _normalised(torch.load(new / path.name))
        if a.keys() != b.keys():
            print(f"{path.stem:32s} KEYS DIFFER: {sorted(set(a) ^ set(b))[:6]}")
            differing += 1
            continue
        diff = [k for k in a if not (torch.equal(a[k], b[k]) or bool(a[k].isnan().all() and b[k].isnan().all()))]
        worst = max((float((a[k].double() - b[k].double()).abs().max()) for k in diff), default=0.0)
        print(f"{path.stem:32s} tensors={len(a):4d} bitwise={'yes' if not diff else 'NO'} differing={len(diff)} max_abs_diff={worst:.2e}")
        differing += bool(diff)
    return 1 if differing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump")
    dumping.add_argument("out", type=Path)
    dumping.add_argument("configs", nargs="+")
    dumping.add_argument("--rounds", type=int, default=12)
    comparing = commands.add_parser("compare")
    comparing.add_argument("old", type=Path)
    comparing.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.configs, args.rounds)
    else:
        sys.exit(compare(args.old, args.new))


if __name__ == "__main__":
    main()
