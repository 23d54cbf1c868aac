"""Stacked tables of per-client tensors: ``data [capacity, *shape]`` and ``has [capacity]``, one row per client.

``_Table`` lives in the process's memory (``ClientStore``); ``_MappedTable`` lives in a file mapped into
memory (``DiskClientStore``), read and written in place through the page cache.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor


class _Table:
    """One (state, param)'s tensors of every client that holds it: ``data[row]``, where ``has[row]``."""

    def __init__(self, like: Tensor, capacity: int) -> None:
        self.data = torch.empty((capacity, *like.shape), dtype=like.dtype, device=like.device)
        self.has = torch.zeros(capacity, dtype=torch.bool)

    def fits(self, tensor: Tensor) -> bool:
        return tensor.shape == self.data.shape[1:] and tensor.dtype == self.data.dtype

    def grow(self, capacity: int) -> None:
        data = torch.empty((capacity, *self.data.shape[1:]), dtype=self.data.dtype, device=self.data.device)
        data[: len(self.data)] = self.data
        has = torch.zeros(capacity, dtype=torch.bool)
        has[: len(self.has)] = self.has
        self.data, self.has = data, has


_ALIGN = 4096  # data starts on a page (and file-system block) boundary: mappable, and copied by reflink where possible


class _MappedTable(_Table):
    """A ``_Table`` in one file mapped shared into memory: ``has`` in the first ``capacity`` bytes, ``data``
    from the next multiple of 4096 bytes on. Rows are read (``index_select``) and written (``index_copy_``) in
    place; what is resident is page cache, which the kernel reclaims, not the process's own memory.

    Each file is allocated in full when made (``posix_fallocate``), so a full disk fails there as an
    ``OSError`` rather than later as a SIGBUS on a write through the map. Growth makes a larger file (named by
    ``new_path``), copies the rows and deletes the old file.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, capacity: int, new_path: Callable[[], Path], path: Path | None = None) -> None:
        self.shape, self.dtype, self._new_path = tuple(shape), dtype, new_path
        self._map(capacity, path)

    @staticmethod
    def layout(shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> tuple[int, int]:
        """(offset of ``data``, size of the file) in bytes."""
        offset = -(-capacity // _ALIGN) * _ALIGN
        return offset, offset + capacity * math.prod(shape) * dtype.itemsize

    @property
    def capacity(self) -> int:
        return len(self.has)

    def _map(self, capacity: int, existing: Path | None) -> None:
        offset, size = self.layout(self.shape, self.dtype, capacity)
        path = existing or self._new_path()
        if existing is None:
            allocate(path, size)
        raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.path, self.raw = path, raw
        self.has = raw[:capacity].view(torch.bool)
        self.data = raw[offset:].view(self.dtype).view(capacity, *self.shape)

    def grow(self, capacity: int) -> None:
        old_path, has, data = self.path, self.has, self.data
        self._map(capacity, None)
        self.has[: len(has)] = has
        self.data[: len(data)] = data
        old_path.unlink(missing_ok=True)

    def save(self, path: Path, rows: int) -> None:
        """The table's first ``rows`` rows as a table file of capacity ``rows`` (the slack of geometric
        growth left out), copied from file to file by the kernel."""
        offset, _ = self.layout(self.shape, self.dtype, self.capacity)
        to, size = self.layout(self.shape, self.dtype, rows)
        with open(self.path, "rb") as src, open(path, "wb") as dst:
            os.ftruncate(dst.fileno(), size)
            copy_range(src.fileno(), dst.fileno(), 0, 0, rows)
            copy_range(src.fileno(), dst.fileno(), offset, to, size - to)

    def close(self) -> None:
        """Unmap (the file stays): the map goes with the last reference to its tensors."""
        self.raw = self.has = self.data = None


def allocate(path: Path, size: int) -> None:
    """A new file of ``size`` zero bytes with its blocks reserved, written as ``<path>.tmp`` and renamed."""
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as handle:
            try:
                os.posix_fallocate(handle.fileno(), 0, size)
            except OSError as error:  # a file system without fallocate: a sparse file
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(handle.fileno(), size)
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        from fl_lightning.core.errors import write_failure

        after = "every client's previous state and the last checkpoint are intact"
        raise write_failure(error, "DiskClientStore table file", path, size, after) from error


def copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """``count`` bytes from one file to another by ``copy_file_range`` (in the kernel; a reflink, no data
    copied, where the file system shares blocks, e.g. btrfs or XFS), else by reading and writing."""
    kernel = hasattr(os, "copy_file_range")
    while count > 0:
        done = 0
        if kernel:
            try:
                done = os.copy_file_range(src, dst, count, src_offset, dst_offset)
            except OSError as error:  # across file systems on older kernels, or a file system without it
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
                kernel = False
        if not done:
            data = os.pread(src, min(count, 1 << 24), src_offset)
            if not data:
                raise OSError(errno.EIO, f"the file ended {count} bytes early")
            done = os.pwrite(dst, data, dst_offset)
        count, src_offset, dst_offset = count - done, src_offset + done, dst_offset + done


def copy_file(src: Path, dst: Path) -> None:
    """A whole file, by ``copy_range``."""
    with open(src, "rb") as source, open(dst, "wb") as target:
        copy_range(source.fileno(), target.fileno(), 0, 0, os.fstat(source.fileno()).st_size)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
