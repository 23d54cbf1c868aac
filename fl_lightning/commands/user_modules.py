"""``--import MODULES``: the user's own modules, imported before any config is parsed.

A module that registers a data source (``@register("name")`` of ``datamodules.sources``), an
algorithm, a model or an executor is imported by ``fl-lightning --import my_algos,my_data fit ...``
(or ``fit --import ...``; the option may repeat), so that ``dataset: name`` and
``class_path: my_algos.MyRule`` resolve. Modules are found on ``sys.path``: PYTHONPATH, the
installed packages and, as with ``python -m``, the current directory (appended here, after the
installed packages, so that a local file never shadows an installed module of the same name).
"""

from __future__ import annotations

import importlib
import os
import sys

from fl_lightning.core.errors import one_line

OPTION = "--import"


def take_import_option(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without its ``--import X`` / ``--import=X`` options, and the modules they name (in order)."""
    rest, modules = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == OPTION:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError("--import needs module names, e.g. --import my_algos,my_data")
            value, i = argv[i + 1], i + 2
        elif isinstance(arg, str) and arg.startswith(OPTION + "="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            rest.append(arg)
            i += 1
            continue
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names:
            raise ValueError("--import needs module names, e.g. --import my_algos,my_data")
        modules += names
    return rest, modules


def add_working_directory() -> None:
    """The current directory on ``sys.path`` (last), as ``python -m`` has it (first there)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def import_user_modules(names: list[str]) -> None:
    """Import ``names``; a module that fails to import raises ``ValueError`` naming it, in one line."""
    add_working_directory()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 -- any failure of the user's module is reported in one line
            hint = (
                "put the folder that holds it on PYTHONPATH or run from that folder"
                if isinstance(error, ModuleNotFoundError) and error.name and name.startswith(error.name)
                else "the error is raised inside the module"
            )
            raise ValueError(f"--import: cannot import module {name!r} ({one_line(error)}); {hint}") from error
