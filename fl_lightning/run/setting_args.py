"""Reading a command's settings without Lightning: its ``--key value`` flags, the config files it names,
which file set a key, and the line for an unknown class name. Shared by the early checks of keys
(``setting_check``) and of values (``setting_ranges``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fl_lightning.core.errors import did_you_mean

_MISSING = object()


def _flags(args: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg in ("--config", "--print_config") or arg.startswith(("--config=", "--print_config=")):
            continue
        key, eq, value = arg[2:].partition("=")
        if "+" in key or key in ("help", "help-all"):
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        out.append((key, value))
    return out

def unknown_class_line(key: str, value: str, names: list[str], kind: str, where: str) -> str:
    near = did_you_mean(value.rsplit(".", 1)[-1], names, quiet=True)
    hint = f"did you mean {near}? " if near else ""
    return f"--{key}: no {kind} named {value!r}{where}; {hint}allowed: {', '.join(names)} (or the full import path of your own subclass)"

def config_files(args: list[Any]) -> list[Path]:
    """The existing config files named by ``--config``/``-c`` in ``args`` (non-string arguments skipped)."""
    files = []
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            continue
        if arg in ("--config", "-c") and i + 1 < len(args) and isinstance(args[i + 1], str):
            files.append(Path(args[i + 1]))
        elif arg.startswith("--config="):
            files.append(Path(arg.split("=", 1)[1]))
    return [f for f in files if f.is_file()]

def source(key: str, value: Any, args: list[str]) -> Path | None:
    """The last config file of ``args`` (later files override earlier ones) that sets ``key`` (to ``value``)."""
    found = None
    for path in config_files(args):
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            continue
        for section in (data, data.get("fit") if isinstance(data, dict) else None):
            node: Any = section
            for part in key.split("."):
                if isinstance(node, dict) and part == "init_args" and "init_args" not in node:
                    continue  # a YAML short form without init_args
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if isinstance(node, dict) and value is not None:
                node = node.get("class_path", _MISSING)
            if node is not _MISSING and (value is None or str(node) == str(value)):
                found = path
    return found
