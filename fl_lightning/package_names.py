"""Import names that are not where the files are: the bundled model and data packages, and the modules
that moved into the package's folders.

``MOVED``: the package's modules once lay flat in ``fl_lightning/``; each now lies in the folder of its
part (docs/architecture.md, "Layout"). The old name (``fl_lightning.module``, a YAML ``class_path``
``fl_lightning.callbacks.GlobalCost``, a checkpoint whose pickles name ``fl_lightning.state``) keeps
working as the *same* module object as the new one (``fl_lightning.engine.module``): ``MovedModules``,
installed when ``fl_lightning`` is imported, in a checkout and in the wheel alike.

The bundled model and data packages: ``fl_lightning.models`` and ``fl_lightning.datamodules``.

The repository keeps them as top-level folders (``models/``, ``datamodules/``); the wheel installs
them inside ``fl_lightning`` (setup.py maps the folders), so a user's own ``models/`` package is
never shadowed. In a repository checkout, ``RepositoryPackages`` (installed when ``fl_lightning``
is imported) makes ``fl_lightning.models[.x]`` load from ``<repo>/models[/x]`` and keeps the old
names ``models``/``datamodules`` working as the *same* modules (one class per model, whichever name
imported it), but only while the old name resolves to this repository's folder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

BUNDLED = ("models", "datamodules")
# package -> the modules that moved there from fl_lightning/ (old name fl_lightning.<module>)
MOVED: dict[str, tuple[str, ...]] = {
    "core": ("params", "state", "tasks", "errors", "capabilities", "config", "participation", "client_data",
        "metrics", "objective", "local_loss", "client_rows", "hub"),
    "reliability": ("faults", "checkpoint_io", "csv_resume", "fingerprint", "stopping"),
    "pipeline": ("messages", "privacy", "privacy_accounting"),
    "engine": ("module", "callbacks", "personal_eval", "instruction_eval"),
    "run": ("cli_app", "config_files", "config_errors", "bundled_configs", "launch", "threads", "terminal",
        "export"),
    "experiments": ("compare", "sweep", "tables", "plots", "history", "montecarlo", "partition_plot",
        "testing"),
    "commands": ("cli", "user_modules", "lora_fixture"),
}
PACKAGE = Path(__file__).resolve().parent
REPOSITORY = PACKAGE.parent


def in_repository() -> bool:
    """The source layout: ``models/`` beside ``fl_lightning/``, not inside it."""
    return not (PACKAGE / "models").is_dir() and (REPOSITORY / "models" / "__init__.py").is_file()


def new_name(old: str) -> str:
    """``models.SmallCNN`` -> ``fl_lightning.models.SmallCNN`` (other names unchanged)."""
    top = old.split(".", 1)[0]
    return f"fl_lightning.{old}" if top in BUNDLED else old


def moved_name(old: str) -> str | None:
    """``fl_lightning.module[.x]`` -> ``fl_lightning.engine.module[.x]``; None for a name that did not move."""
    top, _, rest = old.partition(".")
    module, dot, tail = rest.partition(".")
    package = _MOVED_TO.get(module) if top == "fl_lightning" else None
    return f"fl_lightning.{package}.{module}{dot}{tail}" if package else None


_MOVED_TO = {module: package for package, modules in MOVED.items() for module in modules}


class _Alias(importlib.abc.InspectLoader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec):  # the module already loaded under the new name
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass

    def get_source(self, fullname):
        return None

    def get_code(self, fullname):
        """``python -m <old name>`` (runpy reads the code): the new module's code."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec and spec.loader else None

    def is_package(self, fullname) -> bool:
        return False


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds a moved module's old name: the module loaded under its new name (``MOVED``)."""

    def find_spec(self, fullname, path=None, target=None):
        new = moved_name(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new)) if new else None


class RepositoryPackages(importlib.abc.MetaPathFinder):
    """Finds ``fl_lightning.models``/``fl_lightning.datamodules`` in a checkout and aliases their old names."""

    def find_spec(self, fullname, path=None, target=None):
        top, _, rest = fullname.partition(".")
        if top == "fl_lightning" and rest in BUNDLED:
            folder = REPOSITORY / rest
            return importlib.util.spec_from_file_location(
                fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )
        if top in BUNDLED and self._ours(top):
            return importlib.machinery.ModuleSpec(fullname, _Alias(f"fl_lightning.{fullname}"))
        return None

    @staticmethod
    def _ours(top: str) -> bool:
        """Whether the old top-level name resolves to this repository's folder (a user's own wins)."""
        spec = importlib.machinery.PathFinder.find_spec(top)
        origin = getattr(spec, "origin", None)
        return origin is not None and Path(origin).resolve() == REPOSITORY / top / "__init__.py"


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
    if in_repository() and not any(isinstance(f, RepositoryPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, RepositoryPackages())


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _importable(dotted: str) -> bool:
    module, _, attribute = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attribute)
    except ImportError:
        return False


def refuse_old_names(args: list) -> None:
    """A ``class_path`` written with an old name (``models.SmallCNN``) that does not resolve here (an
    installed fl-lightning, or a ``models`` package of the user's own without that class) is one line
    naming the new name; in a checkout the old names keep working."""
    import yaml

    values = [a for a in args if isinstance(a, str)]
    for i, arg in enumerate(args[:-1]):
        if arg in ("--config", "-c") and isinstance(args[i + 1], str) and Path(args[i + 1]).is_file():
            try:
                values += list(_strings(yaml.safe_load(Path(args[i + 1]).read_text())))
            except (OSError, yaml.YAMLError):
                continue  # the parser reports it
    for value in values:
        top = value.split(".", 1)[0]
        if top in BUNDLED and "." in value and value.replace(".", "").replace("_", "").isalnum():
            if not _importable(value) and _importable(new_name(value)):
                raise ValueError(
                    f"class_path {value}: the bundled {top} are fl_lightning.{top} (a {top} package of your own "
                    f"is never shadowed); write {new_name(value)}"
                )
