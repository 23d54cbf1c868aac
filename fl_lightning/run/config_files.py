"""Fit configs composed from a base: a config file's top-level ``base:`` names the config it overrides.

``fl-lightning fit --config configs/fedprox_digits.yaml``, where that file starts with
``base: quickstart.yaml``, runs as ``--config configs/quickstart.yaml --config configs/fedprox_digits.yaml``
(LightningCLI's repeated ``--config``: later files override earlier ones). Bases chain; a relative
``base`` is looked up beside the file, then in the working directory.

Every config file is read by ``load_yaml``: a YAML syntax error or a key given twice in one
mapping (YAML's "the last one wins", silently) is one line naming the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (lines {seen[key]} and {line}: YAML would keep only the last)", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path | str) -> Any:
    """The YAML file's content; a syntax error or a duplicate key is a ValueError naming the file and line."""
    path = Path(path)
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = str(error.problem or error.context or "not valid YAML").strip()
        hint = "remove one of them" if problem.startswith("duplicate key") else "fix the file (YAML syntax: `key: value`, two-space indents)"
        raise ValueError(f"{path}{where}: {problem}; {hint}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None

def expand_bases(args: list[str]) -> list[str]:
    """``args`` with every ``--config FILE`` (or ``-c``) preceded by the chain of its bases."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--config", "-c") and i + 1 < len(args):
            out += [*_bases(args[i + 1], ()), arg, args[i + 1], *_relative_files(args[i + 1])]
            i += 2
            continue
        if isinstance(arg, str) and arg.startswith("--config="):
            out += _bases(arg.split("=", 1)[1], ())
        out.append(arg)
        i += 1
    return out


def bases_named(paths: list[Path]) -> set[Path]:
    """The resolved files that some file of ``paths`` names as its ``base``."""
    named = set()
    for path in paths:
        try:
            raw = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(raw, dict) and isinstance(raw.get("base"), str):
            try:
                named.add(_resolve(path, raw["base"]))
            except ValueError:
                continue  # expand_bases has reported it
    return named


def _bases(value: str, seen: tuple[Path, ...]) -> list[str]:
    path = Path(value)
    if not isinstance(value, str) or not path.is_file():
        return []  # a YAML string, or a missing file the parser reports
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} is {'empty' if raw is None else 'not a YAML mapping of settings'}; "
                         "see `fl-lightning fit --print_config` for every setting")  # fmt: skip
    if raw.get("base") is None:
        return []
    base = _resolve(path, raw["base"])
    if base in seen or base == path.resolve():
        raise ValueError(f"base: {path} and its bases form a loop through {base}")
    return [*_bases(str(base), (*seen, path.resolve())), "--config", str(base), *_relative_files(str(base))]


RELATIVE_FILES = (("model", "clock", "trace"),)
"""Settings that name a file: a relative path in a config file is resolved against the config's folder (as ``base:``)
when the file lies there, else against the working directory."""


def _relative_files(value: str) -> list[str]:
    """``--<setting> <absolute path>`` for each ``RELATIVE_FILES`` setting the config file sets to a file beside it."""
    path = Path(value)
    raw = load_yaml(path) if isinstance(value, str) and path.is_file() else None
    out = []
    for keys in RELATIVE_FILES:
        node: object = raw
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict) and "init_args" in node and key != keys[-1]:
                node = {**node, **(node.get("init_args") or {})}
        if isinstance(node, str) and not Path(node).is_absolute() and (path.parent / node).is_file():
            out += [f"--{'.'.join(keys)}", str((path.parent / node).resolve())]
    return out


def _resolve(path: Path, base: object) -> Path:
    if not isinstance(base, str) or not base:
        raise ValueError(f"base in {path} must be the path of a config file, got {base!r}")
    for candidate in (path.parent / base, Path.cwd() / base):
        if candidate.is_file():
            return candidate.resolve()
    from fl_lightning.run.bundled_configs import find

    bundled = find(base)  # a config shipped with the package, by name
    if bundled is not None:
        return bundled.resolve()
    raise ValueError(f"base in {path}: config {base!r} not found beside it or in the working directory")
