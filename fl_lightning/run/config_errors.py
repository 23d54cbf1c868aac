"""jsonargparse's parse errors as one line: the setting, where it was given, and what is allowed.

jsonargparse answers a bad setting with the whole usage block and a nested, multi-line
message. ``OneLineParser.error`` (the parser class of ``fl-lightning fit|validate|test|predict``)
prints one line instead and exits with code 2 (``--help`` still prints the usage):

- an unknown class (``--model.algorithm FedProxx``): the allowed names and the nearest one;
- an unknown key (``--model.local.lrr`` or ``lrr:`` in a YAML file): the file that holds it
  and the nearest key;
- a missing config file, a value of the wrong type: the key and the reason.

``FL_LIGHTNING_TRACEBACK=1`` (or ``--debug``) shows jsonargparse's own message.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, get_args

from lightning.pytorch.cli import LightningArgumentParser

from fl_lightning.core.errors import did_you_mean
from fl_lightning.run.setting_check import class_kind, unknown_class_line, unknown_key_line
from fl_lightning.run.setting_check import source as _source_in

PROJECT_PACKAGES = ("fl_lightning", "models", "datamodules")
_ARGS: list[str] = []  # the command's arguments (bases expanded): where a setting came from


def remember_args(args: Any) -> None:
    _ARGS[:] = [a for a in args if isinstance(a, str)] if isinstance(args, list) else []


class OneLineParser(LightningArgumentParser):
    """A LightningArgumentParser whose errors are one line (see the module)."""

    def error(self, message: str, ex: Optional[Exception] = None):  # type: ignore[override]
        if not self.exit_on_error or os.environ.get("FL_LIGHTNING_TRACEBACK"):
            return super().error(message, ex)
        try:
            line = explain(getattr(ex, "subcommand_parser", None) or self, message)
        except Exception:  # never hide the error behind a failure to explain it
            line = collapse(message)
        sys.stderr.write(f"fl-lightning: error: {line}\n")
        self.exit(2)

    def schema(self) -> dict[str, Any]:
        """What this (subcommand) parser accepts, for the early check (fl_lightning/run/setting_check.py)."""
        return schema_of(self)


def explain(parser: Any, message: str) -> str:
    """One line for a jsonargparse error ``message`` raised while ``parser`` parsed the command."""
    parser = _subcommand_parser(parser)
    missing = re.search(r'Parser key "config":\s*File does not exist: \'(.+?)\'', message)
    if missing:
        return f"--config {missing[1]}: no such config file (working directory {Path.cwd()})"
    unknown = re.search(r"(?:does not accept option|is not accepted before subcommand \S+|Option) '([^']+)'", message)
    if unknown and "Parser key" not in message:
        return _unknown_key(parser, unknown[1].removeprefix("fit.").removeprefix("--"), yaml_only=True)
    unrecognized = re.search(r"unrecognized arguments: (.*)", message)
    if unrecognized:
        flags = [a for a in unrecognized[1].split() if a.startswith("--")]
        if flags:
            return _unknown_key(parser, flags[0][2:].split("=", 1)[0], yaml_only=False)
        return f"unrecognized arguments: {unrecognized[1]}"
    helped = re.search(r"(?:--)?([\w.]+)\.help: Expected a dot import path string: (\S+)", message)
    if helped and _action_classes(parser, helped[1]):  # --model.algorithm.help FedProxx
        return _unknown_class(helped[1], helped[2], _action_classes(parser, helped[1]))
    keys = re.findall(r'Parser key "([^"]+)"', message)
    if keys:
        key = ".init_args.".join(keys)
        option = re.search(r"Problem with given class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
        if option:
            return _unknown_init_arg(option[1], f"{key}.init_args.{option[2]}", option[2])
        value = _given_value(message)
        if value is not None and re.search(r"Expected a dot import path string|has no attribute|Expected a path but", message):
            bases = _subtypes(message) or _action_classes(parser, key)
            if bases:
                return _unknown_class(key, value, bases)
        return f"--{key}: {collapse(message.split(':', 1)[1] if ':' in message else message)}"
    return collapse(message)


def collapse(message: str) -> str:
    """jsonargparse's nested message on one line, without the union's bookkeeping."""
    skip = ("Subtypes:", "Errors:", "Given value type:", "- Expected a <class 'NoneType'>", "Does not validate against any")
    parts = [line.strip().lstrip("- ").strip() for line in message.splitlines()]
    line = "; ".join(p for p in parts if p and not p.startswith(skip) and "NoneType" not in p) or message.strip()
    line = re.sub(r"Expected a <class '(\w+)'>", lambda m: f"expected {TYPE_WORDS.get(m[1], m[1])}", line)
    return re.sub(r";? ?Given value: ", ", got ", line)


TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false", "dict": "a mapping", "list": "a list"}


# ---- unknown keys ----------------------------------------------------------------------------------
def _subcommand_parser(parser: Any) -> Any:
    action = getattr(parser, "_subcommands_action", None)
    if action is None:
        return parser
    name = next((a for a in _ARGS if a in action.choices), None) or next(iter(action.choices))
    return action.choices[name]


def known_keys(parser: Any) -> list[str]:
    keys = {a.dest for a in parser._actions if a.dest and a.dest not in ("help", "config", "print_config")}
    return sorted(k for k in keys if not k.startswith("_") and "==SUPPRESS==" not in k)


def _unknown_key(parser: Any, key: str, yaml_only: bool) -> str:
    where = _source(key, None) if yaml_only or f"--{key}" not in " ".join(_ARGS) else None
    return unknown_key_line(key, known_keys(parser), where)


def _unknown_init_arg(class_path: str, key: str, option: str) -> str:
    cls = _import(class_path)
    names = [] if cls is None else [
        p for p in inspect.signature(cls.__init__).parameters if p != "self" and not p.startswith("_")
    ]  # fmt: skip
    names = [n for n in names if inspect.signature(cls.__init__).parameters[n].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    near = did_you_mean(option, names, quiet=True)
    where = _source(key, None)
    prefix = f"{where}: unknown key {key}" if where else f"--{key}: unknown setting"
    short = class_path.rsplit(".", 1)[-1]
    hint = f"did you mean {near}? " if near else ""
    return f"{prefix} ({short} has no argument {option!r}); {hint}{short} takes: {', '.join(names) or 'no arguments'}"


# ---- unknown classes ------------------------------------------------------------------------------
def _given_value(message: str) -> str | None:
    for pattern in (r"Given value: (\S+)\s*$", r"Expected a dot import path string: (\S+)", r"Problem with given class_path '([^']+)'", r"Expected a path but (\S+) either"):
        found = re.findall(pattern, message, flags=re.M)
        if found:
            return found[-1]
    return None


def _subtypes(message: str) -> list[type]:
    lines = re.findall(r"Subtypes: \[(.*)\]", message)
    if not lines:
        return []
    found = [_import(path) for path in re.findall(r"<class '([\w.]+)'>", lines[-1])]
    return [c for c in found if inspect.isclass(c) and c not in (type(None), bool, int, float, str, list, dict)]


def _action_classes(parser: Any, key: str) -> list[type]:
    action = next((a for a in parser._actions if a.dest == key), None)
    hint = getattr(action, "_typehint", None)
    out: list[type] = []

    def walk(tp: Any) -> None:
        if inspect.isclass(tp) and tp not in (type(None), bool, int, float, str, list, dict):
            out.append(tp)
        for arg in get_args(tp):
            walk(arg)

    walk(hint)
    return out


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def allowed_classes(bases: list[type]) -> list[str]:
    """The class names a setting of type ``bases`` accepts by short name: the loaded, concrete
    subclasses from this project and from the base's own package (not all of torch for a model)."""
    names: set[str] = set()
    for base in bases:
        top = base.__module__.split(".")[0]
        packages = ("models", "fl_lightning.models") if top == "torch" and base.__name__ == "Module" else (*PROJECT_PACKAGES, top)
        seen, stack = set(), [base]
        while stack:
            cls = stack.pop()
            for sub in cls.__subclasses__():
                if sub not in seen:
                    seen.add(sub)
                    stack.append(sub)
        for cls in seen | {base}:
            if cls.__name__.startswith("_") or inspect.isabstract(cls) or not cls.__module__.startswith(tuple(f"{p}." for p in packages)):
                continue
            if ".tests." in cls.__module__ or cls.__module__.startswith("tests"):
                continue
            names.add(cls.__name__)
    return sorted(names)


def _unknown_class(key: str, value: str, bases: list[type]) -> str:
    plain = key.replace(".init_args.", ".")
    if f"--{key}" not in _ARGS and f"--{plain}" in _ARGS:
        key = plain  # named as it was given: --model.compression.up, not --model.compression.init_args.up
    found = None if f"{value}" in _ARGS else _source(key, value)
    where = f" (in {found})" if found else ""
    return unknown_class_line(key, value, allowed_classes(bases), class_kind(bases), where)


# ---- where a setting came from ----------------------------------------------------------------------
def _source(key: str, value: Any) -> Path | None:
    """The last config file of the command (later files override earlier ones) that sets ``key`` (to ``value``)."""
    return _source_in(key, value, _ARGS)


# ---- the schema of the early check (fl_lightning/run/setting_check.py) ---------------------------------
def schema_of(parser: Any) -> dict[str, Any]:
    """What a subcommand parser accepts: keys, closed groups, class settings' names (see the module)."""
    known = known_keys(parser)
    closed = sorted(a.dest for a in parser._actions if type(a).__name__ == "_ActionConfigLoad" and a.dest)
    classes = {}
    for action in parser._actions:
        bases = _action_classes(parser, action.dest) if getattr(action, "_typehint", None) is not None else []
        if bases and _only_project_classes(action._typehint, bases):
            classes[action.dest] = {"names": allowed_classes(bases), "kind": class_kind(bases)}
    return {"known": known, "closed": closed, "classes": classes}


def _only_project_classes(hint: Any, bases: list[type]) -> bool:
    """A setting whose value can only be a class of this project or None (no strings, lists, torch modules)."""
    ours = tuple(f"{p}." for p in PROJECT_PACKAGES)
    members = get_args(hint) or (hint,)
    return all(m is type(None) or (isinstance(m, type) and not get_args(m) and m.__module__.startswith(ours)) for m in members) and all(
        b.__module__.startswith(ours) for b in bases
    )
