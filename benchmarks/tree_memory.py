"""Peak resident memory of a process tree: this process and every process it starts.

Flower's simulation engine runs its clients in Ray worker processes (plus Ray's own
``gcs_server`` and ``raylet``), so one process's high-water mark says little; this
samples the summed RSS of the whole tree in a background thread and keeps the peak.
Pages shared between processes (Ray's object store in ``/dev/shm``, the copy-on-write
pages of a forked worker) are counted once per process that touches them, as ``ps``
and ``top`` do. Uses psutil when it is installed (``pip install -e .[bench]``), else
reads ``/proc`` directly (Linux).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def _tree_rss_psutil(root: int) -> int:
    import psutil

    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended between listing and reading
    return total


def _tree_rss_proc(root: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def tree_rss_bytes(root: int | None = None) -> int:
    """Summed RSS (bytes) of process ``root`` (default: this one) and all its descendants."""
    root = os.getpid() if root is None else root
    try:
        return _tree_rss_psutil(root)
    except ImportError:
        return _tree_rss_proc(root)


class PeakTreeMemory:
    """Context manager: ``peak_mb`` is the highest summed RSS of the tree seen while inside.

    Sampled every ``interval`` seconds (and once on entry and exit), so a spike shorter
    than the interval can be missed; the benchmarks' memory is held for whole rounds.
    """

    def __init__(self, interval: float = 0.05, root: int | None = None) -> None:
        self.interval, self.root, self.peak_mb = interval, root, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _measure(self) -> None:
        self.peak_mb = max(self.peak_mb, tree_rss_bytes(self.root) / 2**20)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._measure()

    def __enter__(self) -> "PeakTreeMemory":
        self._measure()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._measure()
