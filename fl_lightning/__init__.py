"""fl-lightning: federated optimization on PyTorch Lightning.

The public names below are imported on first use (PEP 562), so that ``fl-lightning --help``
and ``--version`` answer without importing torch and Lightning.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from fl_lightning import package_names as _package_names

_package_names.install()  # a repository checkout: fl_lightning.models/.datamodules from the top-level folders

if TYPE_CHECKING:
    from fl_lightning.algorithms import Algorithm, FedAvg
    from fl_lightning.core.config import LocalTraining
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.core.participation import Participation, RoundPlan, UniformSampling
    from fl_lightning.core.state import ClientStore

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("fl-lightning")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Algorithm": "fl_lightning.algorithms",
    "ClientStore": "fl_lightning.core.state",
    "FedAvg": "fl_lightning.algorithms",
    "FederatedModule": "fl_lightning.engine.module",
    "LocalTraining": "fl_lightning.core.config",
    "Participation": "fl_lightning.core.participation",
    "RoundPlan": "fl_lightning.core.participation",
    "UniformSampling": "fl_lightning.core.participation",
    "apply_threads": "fl_lightning.run.threads",
    "RoundProgressBar": "fl_lightning.run.terminal",
    "quiet_lightning": "fl_lightning.run.terminal",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fl_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
