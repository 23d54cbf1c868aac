"""Checkpoint writes that stream to a temporary file beside the checkpoint.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory (a ``BytesIO``,
then a copy of its bytes: about 3-4x the checkpoint's size at the peak) and writes it through
an fsspec temporary file in the system temp directory, which a killed run leaves behind
(in RAM when that directory is tmpfs). ``StreamingCheckpointIO`` writes local checkpoints with
``torch.save`` straight into ``.<name>.tmp-<host>-<pid>`` in the checkpoint's own folder,
fsyncs it and renames it over the target (atomic); memory grows by little more than the zip
writer's buffers. ``remove_stale_temporaries`` deletes such files of writers that are no
longer running (same host, dead pid) when the next run starts. ``FederatedModule`` installs
both (``setup`` and ``on_fit_start``).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Iterable

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>\d+)$")


def _host(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"


def temporary_name(name: str, host: str, pid: int) -> str:
    """The temporary file a checkpoint ``name`` is written to by process ``pid`` on ``host``."""
    return f".{name}.tmp-{_host(host)}-{pid}"


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class StreamingCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes stream to a temporary file beside the target (see the module)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(temporary_name(target.name, socket.gethostname(), os.getpid()))
        try:
            torch.save(checkpoint, str(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_folder(target.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (where the platform can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync of a folder: the rename itself has happened
    finally:
        os.close(fd)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folders: Iterable[Any]) -> list[Path]:
    """Delete the temporary checkpoint files in ``folders`` whose writer (this host, that pid) is gone."""
    host, removed = _host(socket.gethostname()), []
    for folder in folders:
        folder = Path(str(folder))
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            match = _TEMPORARY.match(path.name)
            if match and match["host"] == host and not _running(int(match["pid"])) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
