"""Unknown keys, unknown class names and values out of range found before Lightning is imported.

Building the ``fit`` parser imports Lightning (about 5.5 s of CPU on a 2-core machine), so a typo
used to cost that long before its one-line error. Every command that builds the parser stores the
parser's *schema* (its keys, which of them are closed groups whose every member is known, and the
class names each class setting accepts; ``OneLineParser.schema``) under a key of the package's source and installed versions
(fl_lightning/run/answer_cache.py). Later commands check their arguments and config files against it
first and stop with the same line the parser would print (fl_lightning/run/config_errors.py):

- ``--model.lrr 0.1`` or ``lrr:`` in a file: a key under a closed group (the top level, ``model``,
  ``model.local``, ``trainer``, ...) that the group does not have;
- ``--model.algorithm FedProxx``: a short class name that no class of the setting's type has.

Anything the schema cannot decide (a key under a class or dict setting, a dotted class path, user
modules given with ``--import``) is left to the parser.

Values need no schema: every documented range (fl_lightning/run/setting_ranges.py, ``RANGES``) is
checked on every command, with the message of the class that would refuse the value. ``check_all``
answers every refused setting of the command, one line each (the command prints them all, exit code 2).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from fl_lightning.core.errors import did_you_mean
from fl_lightning.run.setting_args import _flags, config_files, source, unknown_class_line  # noqa: F401  (imported from here too)

SUBCOMMANDS = ("fit", "validate", "test", "predict")


# ---- the schema -------------------------------------------------------------------------------------
def class_kind(bases: list[type]) -> str:
    return " or ".join(sorted({"model (torch.nn.Module)" if b.__name__ == "Module" else b.__name__ for b in bases}))


def _schema_path(subcommand: str) -> Path | None:
    from fl_lightning.run import answer_cache

    folder = answer_cache.store()
    if folder is None:
        return None
    parts = {"subcommand": subcommand, **answer_cache.environment()}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return folder / f"schema-{digest}.json"


def save_schema(subcommand: str, parser: Any) -> None:
    """Stores what ``parser`` accepts (``schema_of``, fl_lightning/run/config_errors.py) once per source and versions."""
    from fl_lightning.run import answer_cache

    path = _schema_path(subcommand)
    if path is not None and not path.exists():
        answer_cache.save_text(path, json.dumps(parser.schema()))


def load_schema(subcommand: str) -> dict[str, Any] | None:
    path = _schema_path(subcommand)
    try:
        return None if path is None else json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---- the check --------------------------------------------------------------------------------------
def check(args: list[str], schema: dict[str, Any] | None) -> str | None:
    """The first line of ``check_all``, or None."""
    lines = check_all(args, schema)
    return lines[0] if lines else None


def check_all(args: list[str], schema: dict[str, Any] | None, values: bool = True, user_modules: bool = False) -> list[str]:
    """One line per setting of ``args`` (subcommand first, bases expanded) that is refused: unknown keys and
    class names (with the stored ``schema``; None: not checked), then (``values``) values out of their
    documented range and unknown class names inside class settings (fl_lightning/run/setting_ranges.py,
    which needs no schema; with ``user_modules`` imported, their class names are the parser's to judge)."""
    from fl_lightning.run.setting_ranges import refusals

    lines = [] if schema is None else list(_schema_refusals(args, schema))
    for line in refusals(args, class_names=not user_modules) if values else []:
        if line not in lines:
            lines.append(line)
    return lines


def _schema_refusals(args: list[str], schema: dict[str, Any]):
    known, closed, classes = set(schema["known"]), set(schema["closed"]), schema["classes"]
    flags = _flags(args[1:])
    for key, value in flags:
        key = key.removesuffix(".help") if key.removesuffix(".help") in classes else key  # --model.algorithm.help NAME
        if not _accepted(key, known, closed):
            yield unknown_key_line(key, schema["known"], where=None)
        elif key in classes and isinstance(value, str) and not _possible_class(value, classes[key]["names"]):
            yield unknown_class_line(key, value, classes[key]["names"], classes[key]["kind"], where="")
    for path in config_files(args):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return  # the parser reports it
        for section in _sections(data):
            for key, value in _yaml_settings(section, known, closed):
                if not _accepted(key, known, closed):
                    while isinstance(value, dict) and value:  # the parser names the first leaf of an unknown group
                        name, value = next(iter(value.items()))
                        key = f"{key}.{name}"
                    yield unknown_key_line(key, schema["known"], where=source(key, None, args))
                    continue
                name = value.get("class_path") if isinstance(value, dict) else value
                if key in classes and isinstance(name, str) and not _possible_class(name, classes[key]["names"]):
                    given = any(v == name for _, v in flags)
                    found = None if given else source(key, name, args)
                    where = f" (in {found})" if found else ""
                    yield unknown_class_line(key, name, classes[key]["names"], classes[key]["kind"], where)


def _possible_class(value: str, names: list[str]) -> bool:
    """A short name of an allowed class, or a dotted path (its import is the parser's to try)."""
    return "." in value or value in names or value.lower() in ("null", "none")


def _accepted(key: str, known: set[str], closed: set[str]) -> bool:
    """Known, or below a setting whose members the schema does not list (a class, a dict, a list)."""
    if key in known:
        return True
    parts = key.split(".")
    if "init_args" in parts or "class_path" in parts:
        return True  # the class-path form of a group: the parser's to read
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return prefix not in closed
    return False  # nothing of it is known: the top level is closed


def _sections(data: Any) -> list[dict]:
    if not isinstance(data, dict):
        return []
    sections = [{k: v for k, v in data.items() if k not in SUBCOMMANDS}]
    return sections + [data[s] for s in SUBCOMMANDS if isinstance(data.get(s), dict)]


def _yaml_settings(node: dict, known: set[str], closed: set[str], prefix: str = ""):
    """(key, value) of every setting of a config file, descending only into closed groups."""
    for name, value in node.items():
        key = f"{prefix}{name}"
        yield key, value
        if key in closed and isinstance(value, dict):
            yield from _yaml_settings(value, known, closed, f"{key}.")


# ---- the lines (shared with the parser's errors, fl_lightning/run/config_errors.py) ---------------------
def nearest_key(key: str, known: list[str]) -> str | None:
    """The known key nearest to ``key``: a sibling (same parent), then a key below the parent, then any."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    near = did_you_mean(leaf, [k.rpartition(".")[2] for k in siblings], quiet=True)
    if near:
        return f"{parent}.{near}" if parent else near
    below = [k for k in known if parent and k.startswith(f"{parent}.") and not k.endswith(".help")]
    leaves = {}
    for k in below:
        leaves.setdefault(k.rpartition(".")[2], k)
    near = did_you_mean(leaf, list(leaves), quiet=True)
    if near:
        return leaves[near]
    return did_you_mean(key, known, quiet=True)


def unknown_key_line(key: str, known: list[str], where: Path | None) -> str:
    near = nearest_key(key, known)
    if where is not None:
        return f"{where}: unknown key {key}; " + (f"did you mean {near}?" if near else "see `fl-lightning fit --help` for the settings")
    return f"--{key}: unknown setting; " + (f"did you mean --{near}?" if near else "see `fl-lightning fit --help` for the settings")
