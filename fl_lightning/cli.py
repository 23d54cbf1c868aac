"""The ``fl-lightning`` command: LightningCLI over FederatedModule and any FederatedDataModule."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import datamodules  # noqa: F401  (registers datamodule subclasses and partitioners for short class names)
import models  # noqa: F401
from datamodules import FederatedDataModule
from fl_lightning.module import FederatedModule, quiet_known_warnings


def main(args: list[str] | None = None) -> LightningCLI:
    quiet_known_warnings()
    return LightningCLI(
        FederatedModule,
        FederatedDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
