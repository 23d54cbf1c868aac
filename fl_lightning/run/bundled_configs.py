"""The configs shipped with the package, reachable by name: ``fl-lightning fit --config quickstart``.

In the wheel they are ``fl_lightning/configs/*.yaml`` (setup.py maps the repository's ``configs/``
folder there); in a checkout, the ``configs/`` folder itself. A ``--config`` or ``base:`` that names
no existing file is looked up here by name (``quickstart``, ``quickstart.yaml`` or
``configs/quickstart.yaml``). ``fl-lightning configs`` lists them; ``--copy NAME DEST`` copies one
(with the chain of its bases) to edit.
"""

from __future__ import annotations

import argparse
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def configs_dir() -> Path:
    installed = PACKAGE / "configs"
    return installed if installed.is_dir() else PACKAGE.parent / "configs"


def names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def find(name: str) -> Path | None:
    """The bundled config ``name`` names (with or without ``.yaml`` or a leading ``configs/``), or None."""
    stem = Path(name)
    if stem.parts[:1] == ("configs",):
        stem = Path(*stem.parts[1:]) if len(stem.parts) > 1 else stem
    if len(stem.parts) != 1:
        return None
    for candidate in (configs_dir() / stem.name, configs_dir() / f"{stem.name}.yaml"):
        if candidate.suffix == ".yaml" and candidate.is_file():
            return candidate
    return None


def resolve(value: str) -> str:
    """``value`` itself when it is a file (or not a bundled name), else the bundled config's path."""
    if Path(value).exists():
        return value
    found = find(value)
    return str(found) if found is not None else value


def _summary(path: Path) -> str:
    """The config's first comment line."""
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("#"):
            return text.lstrip("#").strip()
        if text:
            break
    return ""


def _bases(path: Path) -> list[Path]:
    import yaml

    chain, seen = [], {path.resolve()}
    while True:
        raw = yaml.safe_load(path.read_text())
        base = raw.get("base") if isinstance(raw, dict) else None
        if not isinstance(base, str):
            return chain
        found = path.parent / base if (path.parent / base).is_file() else find(base)  # configs/x.yaml: by name
        if found is None or found.resolve() in seen:
            return chain
        seen.add(found.resolve())
        chain.append(found)
        path = found


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="fl-lightning configs",
        description="List the configs shipped with fl-lightning (run one by name: fl-lightning fit --config quickstart), "
        "or copy one, with the configs it builds on (base:), into a folder to edit.",
    )
    parser.add_argument("--copy", nargs=2, metavar=("NAME", "DEST"), help="copy config NAME into folder DEST")
    ns = parser.parse_args(argv)
    if ns.copy is None:
        width = max(map(len, names()), default=0)
        for name in names():
            print(f"{name:<{width}}  {_summary(configs_dir() / f'{name}.yaml')}")
        return
    name, dest = ns.copy
    source = find(name)
    if source is None:
        raise ValueError(f"configs --copy: no bundled config {name!r}; `fl-lightning configs` lists them")
    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    files = [source, *_bases(source)]
    copies = {}
    for path in files:
        text = path.read_text()
        base = _base_line(text)
        if base is not None:  # the copy builds on the copied base beside it
            text = text.replace(base[0], f"base: {Path(base[1]).name}", 1)
        target = folder / path.name
        if target.exists() and target.read_text() != text:  # an identical copy (a shared base copied before) is kept
            raise ValueError(f"configs --copy: {target} exists and differs; choose another DEST or remove it")
        copies[target] = text
    for target, text in copies.items():
        if target.exists():
            print(f"kept {target} (already there, identical)")
            continue
        target.write_text(text)
        print(f"wrote {target}")


def _base_line(text: str) -> tuple[str, str] | None:
    """(the ``base: VALUE`` text, VALUE) of a config's top-level base line."""
    import re

    match = re.search(r"^(base:\s*([^\s#]+))", text, flags=re.M)
    return (match.group(1), match.group(2)) if match else None
