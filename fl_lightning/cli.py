"""The ``fl-lightning`` command: LightningCLI over FederatedModule and any FederatedDataModule."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

import datamodules  # noqa: F401  (registers datamodule subclasses and partitioners for short class names)
import models  # noqa: F401
from datamodules import FederatedDataModule
from fl_lightning.errors import KNOWN_ERRORS
from fl_lightning.module import FederatedModule, quiet_known_warnings


def build_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """The LightningCLI object (``run=False`` only parses and instantiates, for validation and tests)."""
    quiet_known_warnings()
    return LightningCLI(
        FederatedModule,
        FederatedDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def _essential(message: str) -> str:
    """Strip jsonargparse's union-type wrapping, keeping the setting's own message."""
    if "Union subtypes" not in message:
        return message
    reasons = [
        line.strip()[2:]
        for line in message.splitlines()
        if line.strip().startswith("- ") and "Expected a <class 'NoneType'>" not in line
    ]
    return "; ".join(reasons) or message


def with_safe_loading(argv: list[str]) -> list[str]:
    """Checkpoints are loaded with ``weights_only=True`` unless the command line says otherwise.

    Everything fl-lightning writes into a checkpoint (tensors, numbers, strings) loads
    that way; a checkpoint needing arbitrary unpickling is refused rather than executed.
    """
    if argv[:1] and argv[0] in ("fit", "validate", "test", "predict") and not any(
        a.startswith("--weights_only") for a in argv
    ):
        return [*argv, "--weights_only", "true"]
    return argv


def main(args: list[str] | None = None) -> None:
    """Console entry point: a bad setting ends with one line naming it (exit code 2).

    ``fl-lightning compare --config SWEEP.yaml --out DIR`` runs a sweep (fl_lightning/compare.py);
    every other subcommand (fit, validate, test, ...) is LightningCLI's.

    Set ``FL_LIGHTNING_TRACEBACK=1`` to see the full traceback instead.
    """
    argv = sys.argv[1:] if args is None else list(args)
    try:
        if argv[:1] == ["compare"]:  # not a LightningCLI subcommand: runs many fits, see fl_lightning/compare.py
            from fl_lightning.compare import main as compare_main

            compare_main(argv[1:])
        else:
            build_cli(with_safe_loading(argv))
    except KNOWN_ERRORS as error:  # a bad setting, divergence, failing clients, a bad checkpoint or store
        if os.environ.get("FL_LIGHTNING_TRACEBACK"):
            raise
        print(f"fl-lightning: error: {_essential(str(error))}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
