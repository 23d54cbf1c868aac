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

Every checkpoint it writes carries the SHA-256 of its bytes in the zip archive's comment
(``seal``; readers of zip files, torch.load included, ignore a comment), and every load checks it
(``verify``): a damaged checkpoint is refused naming the file, whatever bytes were hit. A
checkpoint without that comment (older, or written by another ``CheckpointIO``) has the CRCs of
its archive checked instead. A write that fails (no space, a file-size limit, a read-only folder)
is one line naming the folder, the size needed and the last good checkpoint, which is intact:
the target is only replaced once the new file is complete.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterable

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from fl_lightning.core.errors import CheckpointError, write_failure

_TEMPORARY = re.compile(r"^\..+\.tmp-(?P<host>[A-Za-z0-9_.-]+)-(?P<pid>\d+)$")


def _host(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "host"


def temporary_name(name: str, host: str, pid: int) -> str:
    """The temporary file a checkpoint ``name`` is written to by process ``pid`` on ``host``."""
    return f".{name}.tmp-{_host(host)}-{pid}"


def _is_local(path: Any) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


MAGIC = b"fl-lightning sha256 "
_COMMENT = len(MAGIC) + 64  # the magic and the hex digest
_CHUNK = 1 << 22


class _HashingWriter:
    """The file object torch.save writes through: hashes the bytes and keeps the OSError of a
    failed write (torch reports it as an ``unexpected pos`` RuntimeError without the cause)."""

    def __init__(self, file: Any) -> None:
        self.file, self.hash, self.error = file, hashlib.sha256(), None

    def write(self, data: Any) -> int:
        try:
            written = self.file.write(data)
        except OSError as error:
            self.error = error
            raise
        self.hash.update(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def _seal(file: Any, digest: str) -> None:
    """Set the archive's comment (its last two bytes, the comment length, are 0 as torch wrote them)."""
    file.seek(-2, os.SEEK_END)
    file.write(struct.pack("<H", _COMMENT) + MAGIC + digest.encode())


def verify(path: str | os.PathLike) -> None:
    """Refuse a damaged checkpoint (CheckpointError naming the file): its recorded SHA-256, else its archive's CRCs."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as file:
        if size > _COMMENT + 2:
            file.seek(size - _COMMENT - 2)
            tail = file.read()
        else:
            tail = b""
        if tail[:2] == struct.pack("<H", _COMMENT) and tail[2:].startswith(MAGIC):
            recorded = tail[2 + len(MAGIC) :].decode("ascii", "replace")
            file.seek(0)
            digest, left = hashlib.sha256(), size - _COMMENT - 2
            while left > 0:
                chunk = file.read(min(_CHUNK, left))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            digest.update(b"\0\0")  # the comment length as torch wrote it
            if digest.hexdigest() != recorded:
                raise CheckpointError(
                    f"checkpoint {path} is damaged: its SHA-256 differs from the one recorded when it was written "
                    "(modified or corrupted on disk); resume from another checkpoint, or start without --ckpt_path"
                )
            return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint ({error}); resume from another checkpoint") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} is damaged: the archive's CRC of {bad} does not match; resume from another checkpoint")


def _nbytes(value: Any) -> int:
    """The tensor bytes in a checkpoint (what its file needs, give or take the pickled structure)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _last_good(target: Path) -> str:
    if target.is_file():
        return f"the last good checkpoint {target} is intact (resume with --ckpt_path {target})"
    others = sorted((p for p in target.parent.glob("*.ckpt") if p.is_file()), key=lambda p: p.stat().st_mtime) if target.parent.is_dir() else []
    if others:
        return f"the last good checkpoint {others[-1]} is intact (resume with --ckpt_path {others[-1]})"
    return "no checkpoint was written before this one"


class StreamingCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes stream to a temporary file beside the target, sealed
    with their SHA-256, and whose loads verify it (see the module)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(str(path).removeprefix("file://"))
        tmp = target.with_name(temporary_name(target.name, socket.gethostname(), os.getpid()))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as file:
                writer = _HashingWriter(file)
                try:
                    torch.save(checkpoint, writer)
                except RuntimeError:
                    if writer.error is not None:
                        raise writer.error from None
                    raise
                _seal(file, writer.hash.hexdigest())
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, target)
            _fsync_folder(target.parent)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            if error.errno is None:
                raise
            raise write_failure(error, "checkpoint", target, _nbytes(checkpoint), _last_good(target)) from error
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if _is_local(path) and Path(str(path).removeprefix("file://")).is_file():
            verify(Path(str(path).removeprefix("file://")))
        return super().load_checkpoint(path, *args, **kwargs)


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
