"""Stored answers of the read-only requests of ``fit``/``validate``/``test``/``predict``.

``fit --help-all``, ``fit --model.algorithm.help FedProx`` and ``fit --config F --print_config`` only
print what the parser knows, but building that parser imports Lightning (about 5 s of CPU on a
2-core machine: torch, ``torch._dynamo`` and torchmetrics, which imports transformers). The answer
depends on nothing but the arguments, the config files they name (with their ``base:`` chain), the
source of fl-lightning, the installed versions and the terminal width, so the first answer is
stored under that key and later identical requests print it without importing Lightning.

The store is ``$FL_LIGHTNING_CACHE_DIR`` (default ``~/.cache/fl-lightning``), one small text file
per answer; ``FL_LIGHTNING_CACHE_DIR=off`` disables it. A request that imports user modules
(``--import``) is never stored: their source is not part of the key.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

READ_ONLY_FLAGS = ("-h", "--help", "--help-all", "--print_config")
DISTRIBUTIONS = ("fl-lightning", "lightning", "jsonargparse", "torch", "torchmetrics", "transformers", "peft")
SOURCE_FOLDERS = ("models", "datamodules", "configs")  # beside fl_lightning/ in a checkout, inside it in the wheel


def store() -> Path | None:
    setting = os.environ.get("FL_LIGHTNING_CACHE_DIR", "")
    if setting.lower() == "off":
        return None
    root = Path(setting) if setting else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fl-lightning"
    return root / "answers"


def is_read_only(argv: list[str]) -> bool:
    """A Lightning subcommand asking for help or the composed config, and nothing else."""
    return any(a in READ_ONLY_FLAGS or a.startswith("--print_config=") or a.endswith(".help") for a in argv[1:])


def key(argv: list[str]) -> str:
    """Everything the answer depends on: arguments, named files (bases included), source, versions, width."""
    from fl_lightning.run.config_files import expand_bases

    expanded = expand_bases(list(argv))  # every --config preceded by its base: chain
    parts = {
        **environment(),
        "argv": expanded,
        "files": {a: _digest(Path(a)) for a in expanded if Path(a).is_file()},
        "columns": shutil.get_terminal_size().columns,
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("FL_LIGHTNING", "JSONARGPARSE", "COLUMNS", "PYTHONPATH"))},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def environment() -> dict[str, Any]:
    """What every stored answer and schema depends on beyond its request: the package's source, the
    installed versions, the Python (computed once per process: a command asks for it more than once)."""
    return {"source": source_state(), "versions": versions(), "python": sys.version}


def source_state() -> list:
    """Path, size and modification time of every source file of the package (an edit changes the key);
    in a repository checkout also of the top-level models/, datamodules/ and configs/ folders."""
    from fl_lightning.package_names import PACKAGE, REPOSITORY, in_repository

    roots = [PACKAGE] + ([REPOSITORY / name for name in SOURCE_FOLDERS] if in_repository() else [])
    state = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".yaml"):
                stat = path.stat()
                state.append((str(path), stat.st_size, stat.st_mtime_ns))
    return state


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = ""
    return found


def request_key(argv: list[str]) -> str | None:
    """The key of a storable request, or None (store disabled, or a config the slow path must report on)."""
    if store() is None:
        return None
    try:
        return key(argv)
    except (OSError, ValueError):  # a missing or broken config file: the parser's one-line error says which
        return None


def lookup(name: str) -> str | None:
    try:
        return (store() / f"{name}.txt").read_text()
    except OSError:  # not stored yet (or unreadable: then it is answered the slow way)
        return None


@contextmanager
def recording(name: str) -> Iterator[None]:
    """Shows the answer as it is printed and stores it if the request ends with exit code 0."""
    tee = _Tee(sys.stdout)
    saved, sys.stdout = sys.stdout, tee
    try:
        yield
    except SystemExit as done:
        if done.code in (None, 0):
            _save(store(), name, tee.text.getvalue())
        raise
    else:
        _save(store(), name, tee.text.getvalue())
    finally:
        sys.stdout = saved


def _save(folder: Path, name: str, text: str) -> None:
    if text:
        save_text(folder / f"{name}.txt", text)


def save_text(path: Path, text: str) -> None:
    """Atomic (a concurrent reader sees the whole file or none); a store that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        pass  # only the next request's speed depends on it


class _Tee(io.TextIOBase):
    def __init__(self, stream) -> None:
        self.stream = stream
        self.text = io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")

    def fileno(self) -> int:
        return self.stream.fileno()
