"""The GPU check of ``benchmarks/device_check.sh``: the realistic rows of ``benchmarks/run.py`` (eager and
compiled, each with stacked_fraction and padding_waste), ResNet-18 on CIFAR-shaped synthetic images and a GPT-2-small-shaped LoRA round
(``benchmarks/lora_round.py``, random weights), each step in its own process group under a time limit,
all of it within ``--budget`` seconds, written as one JSON file.

    python benchmarks/device_check.py --out device_check.json             # CUDA
    python benchmarks/device_check.py --cpu-smoke --out smoke.json         # everything shrunk, on the CPU

A step that fails or runs out of time records its command, return code and the end of its output under
``error``; the next step runs. Nothing is downloaded: every model and data set is written locally.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REALISTIC = "mlp_realistic,cnn_realistic"


def steps(smoke: bool, scratch: Path) -> list[dict]:
    """The check's steps, cheapest and surest first (compiled rows last: compilation time is the least
    predictable, and the check's budget cuts the last step short): a name, the command (``--out`` is
    added) and a time limit in seconds."""
    run = [sys.executable, "benchmarks/run.py", "--device", "cpu" if smoke else "cuda", "--quick"]
    rounds = "mlp_realistic=2,cnn_realistic=2,resnet18=2" if smoke else "mlp_realistic=12,cnn_realistic=10,resnet18=3"
    eager, compiled = [*run, "--rounds", rounds, "--repeats", "1" if smoke else "2"], [*run, "--rounds", rounds, "--repeats", "1"]
    lora = ["--size", "tiny", "--sweep", "2", "--rounds", "2", "--steps", "1", "--batch-size", "4", "--max-length", "32"] if smoke else [
        "--size", "small", "--sweep", "5", "--rounds", "3", "--steps", "2", "--batch-size", "8", "--max-length", "128"]  # fmt: skip
    return [
        dict(name="mlp_realistic", limit=60, command=[*eager, "--workloads", "mlp_realistic", "--executions", "bare,sequential,batched"]),
        dict(name="cnn_realistic", limit=45, command=[*eager, "--workloads", "cnn_realistic", "--executions", "bare,sequential,batched"]),
        dict(name="resnet18", limit=60, command=[*eager, "--workloads", "resnet18", "--executions", "bare,sequential,batched"]),
        dict(name="lora_round", limit=100, command=[sys.executable, "benchmarks/lora_round.py", "--device", "cpu" if smoke else "cuda", *lora,
                                                    "--assets", str(scratch / "lora_assets")]),  # fmt: skip
        dict(name="mlp_realistic_compiled", limit=130, command=[*compiled, "--workloads", "mlp_realistic", "--executions", "bare,batched_compiled"]),
        dict(name="cnn_realistic_compiled", limit=110, command=[*compiled, "--workloads", "cnn_realistic", "--executions", "bare,batched_compiled"]),
    ]


def run_step(step: dict, out: Path, limit: float) -> dict:
    """One step in its own session (a time-out kills its workers too); its rows, or why there are none."""
    command = [*step["command"], "--out", str(out)]
    record = {"name": step["name"], "command": " ".join(command[1:]), "limit_s": round(limit)}
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        record["error"] = f"timed out after {limit:.0f} s"
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["returncode"] = process.returncode
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    if rows:
        record["rows"] = rows
    elif "error" not in record:
        record["error"] = f"no rows (return code {process.returncode})"
    if "error" in record:
        record["output_tail"] = output[-3000:]
    print(f"{step['name']}: {record.get('error', f'{len(rows)} rows')} ({record['seconds']} s)", flush=True)
    return record


def summary(records: list[dict]) -> list[dict]:
    """The realistic rows side by side: speed against the bare loop, stacked fraction, padding waste."""
    return [
        {k: row.get(k) for k in ("workload", "execution", "clients_per_round", "client_steps_per_s", "ratio_vs_bare", "stacked_fraction", "padding_waste")}
        for record in records for row in record.get("rows", []) if row.get("workload", "").endswith("_realistic")
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file written")
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU, every step shrunk to a couple of rounds")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all steps together (default 450: with start-up, under 8 minutes)")
    parser.add_argument("--only", default=None, help="comma-separated step names (default: all)")
    args = parser.parse_args()
    import torch

    from benchmarks.run import machine

    info = machine()
    if not args.cpu_smoke:
        info["gpu"] = torch.cuda.get_device_name()
    scratch = Path(tempfile.mkdtemp(prefix="fl_device_check_"))
    started, records = time.perf_counter(), []
    scale = 3 if args.cpu_smoke else 1  # the limits are for the GPU: a shared CPU gets three times as long
    chosen = [s for s in steps(args.cpu_smoke, scratch) if args.only is None or s["name"] in args.only.split(",")]
    for step in chosen:
        left = args.budget * scale - (time.perf_counter() - started)
        if left < 20:
            records.append({"name": step["name"], "error": f"skipped: the check's {args.budget:.0f} s were spent"})
            continue
        records.append(run_step(step, scratch / f"{step['name']}.json", min(step["limit"] * scale, left)))
    result = {
        "machine": info, "date": time.strftime("%Y-%m-%d %H:%M"), "cpu_smoke": args.cpu_smoke,
        "total_s": round(time.perf_counter() - started, 1), "realistic": summary(records), "steps": records,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    failed = [r["name"] for r in records if "error" in r]
    print(f"device check: {len(records) - len(failed)} of {len(records)} steps ran ({result['total_s']} s)"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; results: {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
