"""Cost of a round's gather + scatter and of a checkpoint with the disk client store.

    python benchmarks/disk_store_rounds.py --clients 10000 --floats 100000 --per-round 50

N clients each hold one state of ``--floats`` float32 (an MLP-sized SCAFFOLD c_i); a round gathers S
random clients' states and scatters new ones; a checkpoint snapshots the store. Prints seconds (median
of ``--repeats``), the snapshot's size, and the process's resident memory split into its own
(anonymous) pages and file pages (page cache mapped in). Uses only the store's public methods, so the
same script times any version of ``DiskClientStore`` (put it first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not any(Path(p, "fl_lightning").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fl_lightning.core.state import DiskClientStore  # noqa: E402


def _rss() -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("Rss"))
    return {k.lower() + "_mb": round(int(v.split()[0]) / 1024, 1) for k, v in fields.items()}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--floats", type=int, default=100_000)
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the store lives (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    init = lambda: {"c": {"w": torch.zeros(args.floats)}}  # noqa: E731
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = DiskClientStore(tmp)
        start = time.perf_counter()
        for first in range(0, args.clients, 500):  # every client holds a state
            ids = torch.arange(first, min(first + 500, args.clients))
            store.scatter(ids, {"c": {"w": torch.randn(len(ids), args.floats, generator=generator)}})
        fill = time.perf_counter() - start
        rounds = []
        for _ in range(args.repeats):
            ids = torch.randperm(args.clients, generator=generator)[: args.per_round]
            start = time.perf_counter()
            stacked = store.gather(ids, init)
            store.scatter(ids, {"c": {"w": stacked["c"]["w"] + 1}})
            rounds.append(time.perf_counter() - start)
        start = time.perf_counter()
        record = store.checkpoint_state(1)
        checkpoint = time.perf_counter() - start
        snapshot_mb = _size(Path(tmp) / record["disk_snapshot"]) / 2**20
        start = time.perf_counter()
        restored = DiskClientStore(str(Path(tmp) / "restored"))
        restored.load_checkpoint_state(record)
        resume = time.perf_counter() - start
        print(json.dumps(dict(
            clients=args.clients, floats=args.floats, per_round=args.per_round, fill_s=round(fill, 1),
            gather_scatter_s=round(statistics.median(rounds), 4), checkpoint_s=round(checkpoint, 2),
            snapshot_mb=round(snapshot_mb, 1), resume_s=round(resume, 2), **_rss(),
        )))  # fmt: skip
        restored.close()
        store.close()


if __name__ == "__main__":
    main()
