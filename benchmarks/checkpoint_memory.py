"""Peak memory added by writing one checkpoint: Lightning's TorchCheckpointIO vs StreamingCheckpointIO.

    python benchmarks/checkpoint_memory.py --mb 400

Each writer runs in its own process (``ru_maxrss`` only grows); the result is the peak RSS the
write added, in checkpoint sizes (the checkpoint's tensors are already in memory before the write).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import resource, sys, time, torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from fl_lightning.reliability.checkpoint_io import StreamingCheckpointIO
mb, kind, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
checkpoint = {"state_dict": {f"w{i}": torch.randn(1 << 18) for i in range(mb)}}
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before, start = rss(), time.perf_counter()
(StreamingCheckpointIO() if kind == "streaming" else TorchCheckpointIO()).save_checkpoint(checkpoint, path)
print(rss() - before, time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=400, help="checkpoint size in MB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("lightning", "streaming"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.mb), kind, os.path.join(tmp, f"{kind}.ckpt")],
                                 env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)  # fmt: skip
            added, seconds = map(float, out.stdout.split())
            size = os.path.getsize(os.path.join(tmp, f"{kind}.ckpt")) / 2**20
            print(json.dumps(dict(writer=kind, checkpoint_mb=round(size), added_peak_mb=round(added),
                                  peak_in_checkpoint_sizes=round(1 + added / size, 2), seconds=round(seconds, 2))))  # fmt: skip


if __name__ == "__main__":
    main()
