"""Load time and peak memory of a LEAF folder of FEMNIST shape (datamodules/leaf.py; docs/fairness.md, "Natural users").

    python benchmarks/leaf_load.py --users 3000 --samples 50

Writes a LEAF folder to a temporary directory (``--per-file`` users a file, as LEAF's ``all_data_*.json``; each user
``--samples`` samples, 90 % train and 10 % test as ``preprocess.sh -t sample --tf 0.9``; pixels 1.0 or k / 255 as
FEMNIST's JSON holds them), then reads it in fresh processes:

- ``read_leaf``: the wall and CPU time (the CPU time is the steadier on a shared machine) and the peak resident memory over the process's start (``ru_maxrss`` less the
  RSS after the imports), and, in a second process, the peak of the traced allocations (``tracemalloc``: numpy
  buffers and the parsed JSON; it slows the parse, so it is timed apart);
- ``naive`` (the comparison): the same files, each user's rows a tensor, all of them concatenated at the end.

It prints one JSON object: the tensors' size and each measurement in MB and seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, resource, sys, time, tracemalloc
from pathlib import Path
sys.path.insert(0, {root!r})
import numpy as np, torch
from datamodules.leaf import leaf_files, read_leaf

def rss_mb():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

def naive(folder):
    xs, ys = [], []
    for split in ("train", "test"):
        for path in leaf_files(folder, split):
            data = json.load(open(path))
            for user in data["users"]:
                xs.append(torch.tensor(data["user_data"][user]["x"], dtype=torch.float32))
                ys.append(torch.tensor(data["user_data"][user]["y"]))
            del data
    return torch.cat(xs).view(-1, 1, 28, 28), torch.cat(ys)

load = (lambda f: read_leaf(f)) if {how!r} == "read_leaf" else naive
base = rss_mb()
if {traced}:
    tracemalloc.start()
start, cpu = time.perf_counter(), time.process_time()
out = load({folder!r})
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
x, y = (out.x, out.y) if {how!r} == "read_leaf" else out
result = dict(seconds=seconds, cpu_seconds=cpu, rows=len(y), tensors_mb=(x.nbytes + y.nbytes) / 2**20,
              peak_rss_over_start_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base)
if {traced}:
    result["tracemalloc_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
print(json.dumps(result))
"""


def write_folder(folder: Path, users: int, samples: int, per_file: int, seed: int = 0) -> int:
    """A LEAF folder of ``users`` FEMNIST users; returns its bytes on disk. Rows are drawn from a pool of 512
    formatted images (writing is then a join of strings; the reader parses every value all the same)."""
    rng = np.random.default_rng(seed)
    pool = np.where(rng.random((512, 784)) < 0.8, 1.0, rng.integers(0, 256, (512, 784)) / 255)
    rows = [json.dumps(row.tolist()) for row in pool]
    size = 0
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True)
    for f, first in enumerate(range(0, users, per_file)):
        names = [f"f{u:05d}_{u % 97:02d}" for u in range(first, min(first + per_file, users))]
        parts: dict[str, list[str]] = {"train": [], "test": []}
        counts: dict[str, list[int]] = {"train": [], "test": []}
        for name in names:
            total = samples + int(rng.integers(-samples // 5, samples // 5 + 1))
            n_train = int(np.ceil(0.9 * total))
            for split, n in (("train", n_train), ("test", total - n_train)):
                picks, labels = rng.integers(0, len(pool), n), rng.integers(0, 62, n).tolist()
                parts[split].append(f'"{name}": {{"x": [{", ".join(rows[i] for i in picks)}], "y": {json.dumps(labels)}}}')
                counts[split].append(n)
        for split in ("train", "test"):
            path = folder / split / f"all_data_{f}_niid_0_keep_0_{split}_9.json"
            path.write_text(f'{{"users": {json.dumps(names)}, "num_samples": {json.dumps(counts[split])}, '
                            f'"user_data": {{{", ".join(parts[split])}}}}}')  # fmt: skip
            size += path.stat().st_size
    return size


def measure(folder: Path, how: str, traced: bool) -> dict:
    code = MEASURE.format(root=str(ROOT), folder=str(folder), how=how, traced=traced)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--per-file", type=int, default=100)
    parser.add_argument("--no-naive", action="store_true", help="skip the comparison load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        size = write_folder(Path(tmp), args.users, args.samples, args.per_file)
        result = {"users": args.users, "samples": args.samples, "per_file": args.per_file, "json_mb": size / 2**20,
                  "read_leaf": measure(Path(tmp), "read_leaf", False),
                  "read_leaf_traced": measure(Path(tmp), "read_leaf", True)}  # fmt: skip
        if not args.no_naive:
            result["naive"] = measure(Path(tmp), "naive", False)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
