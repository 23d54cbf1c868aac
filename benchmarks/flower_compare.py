"""The same FedAvg workload through Flower's simulation engine and through fl-lightning.

    pip install -e ".[bench]"          # flwr[simulation] (Ray) and psutil
    python benchmarks/flower_compare.py [--rounds 20] [--clients-per-round 10] [--repeats 3] [--out F]

Workload: ``benchmarks/run.py``'s ``mlp`` (synthetic data, 32 features, 10 classes, 100
clients IID, ``MLP(32, 10, hidden=[64])``), FedAvg, S clients per round (default 10),
K = 4 local SGD steps of batch 16 at lr 0.05, R rounds (default 20), one torch thread.

Executions, each in its own fresh process (so start-up and memory are its own):

- ``flower``: ``benchmarks/flower_app.py`` (a ``ClientApp`` and a ``ServerApp`` with
  ``FedAvg``) through ``flwr.simulation.run_simulation`` on the Ray backend, 100 virtual
  SuperNodes, ``--flower-actors`` client actors of one CPU each (default 1: the same one
  core that fl-lightning's single process uses; Flower's own default is 2 CPUs a client);
- ``sequential``, ``batched`` and ``batched_compiled``: ``FederatedModule`` + ``Trainer.fit``, as in
  run.py (``batched_compiled``: ``BatchedExecutor(compile=True)``; its compilation falls in round 1,
  so in ``startup_s``, not in ``per_client_fit_ms``).

Per execution and repetition (run interleaved: flower, sequential, batched, flower, ...):

- ``per_client_fit_ms``: steady state, (end of round R - end of round 1) / ((R - 1) S):
  a round's wall time shared over its clients, the server's sampling, messaging and
  aggregation included;
- ``startup_s``: from launching the process to the end of round 1, less one
  steady-state round: imports, Ray and actor start-up, data and model set-up, first-call costs;
- ``inside_client_ms`` (Flower only): the median over rounds 2..R of the clients' mean
  time inside the ``ClientApp``'s ``train`` (model and data set-up, K steps, reply):
  what a client fit costs without the engine's messaging, Ray dispatch and polling
  (``InMemoryGrid`` and the simulation's message queue poll every 0.1 s);
- ``peak_tree_mb``: the highest summed RSS of the process and all its descendants
  (Ray's ``gcs_server``, ``raylet`` and workers), sampled every 50 ms by the launching
  process (``tree_memory.py``); ``own_peak_rss_mb``: the measured process's own
  high-water mark (the kernel's ``VmHWM``; for Flower, the driver alone).

The medians over ``--repeats`` are reported, and each fl-lightning row's ``flower_over_this``:
Flower's median divided by the row's, per field (> 1: fl-lightning faster to fit, faster
to start, leaner), all from the same invocation. Without ``flwr`` (or where Ray cannot start) the Flower row
says why in one line and the fl-lightning rows are still measured. JSON (``--out``,
default ``benchmarks/results/flower-<cpu>-<cores>cpu-<date>.json``):
``{"machine", "date", "workload", "repeats", "rows": [{execution, per_client_fit_ms,
startup_s, peak_tree_mb, own_peak_rss_mb, runs, flower_over_this}], "flwr"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run import WORKLOADS, _quiet, default_out, framework, machine, peak_rss_mb  # noqa: E402
from benchmarks.tree_memory import PeakTreeMemory  # noqa: E402

WORKLOAD = "mlp"
EXECUTIONS = ("flower", "sequential", "batched", "batched_compiled")
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}  # no telemetry: no network calls


def flower_missing() -> str | None:
    """None when Flower's simulation engine can be imported, else why not (one line)."""
    try:
        import flwr.simulation  # noqa: F401
        import ray  # noqa: F401
    except ImportError as err:
        return f"flwr[simulation] is not installed ({err.name or err}); pip install -e '.[bench]'"
    return None


def _flower_round_ends(rounds: int, clients_per_round: int, actors: int) -> tuple[list[float], list[float]]:
    """Round ends and the clients' mean seconds inside ``train`` per round."""
    os.environ.update(QUIET_ENV)
    from flwr.simulation import run_simulation

    from benchmarks.flower_app import client_app, server_app

    report: dict = {}
    run_simulation(
        server_app=server_app(rounds, clients_per_round, report), client_app=client_app,
        num_supernodes=WORKLOADS[WORKLOAD]["num_clients"],
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": actors}},
    )  # fmt: skip
    return report["round_ends"][1:], report.get("fit_seconds", [])  # round_ends[0]: before round 1


def _fl_lightning_round_ends(rounds: int, clients_per_round: int, execution: str) -> list[float]:
    import lightning as L

    class RoundEnds(L.Callback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends.append(time.time())

    _quiet()
    recorder = RoundEnds()
    framework(WORKLOAD, clients_per_round, rounds, execution, callbacks=(recorder,))
    return recorder.ends


def measure(execution: str, rounds: int, clients_per_round: int, actors: int, launched: float) -> dict:
    """One run of ``execution`` in this process; ``launched``: ``time.time()`` when the process was started."""
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {execution!r}")
    if rounds < 2:
        raise ValueError(f"need >= 2 rounds (the first is a warm-up), got {rounds}")
    inside: list[float] = []
    if execution == "flower":
        ends, inside = _flower_round_ends(rounds, clients_per_round, actors)
    else:
        ends = _fl_lightning_round_ends(rounds, clients_per_round, execution)
    if len(ends) != rounds:
        raise RuntimeError(f"{execution}: {len(ends)} round ends recorded for {rounds} rounds")
    steady = (ends[-1] - ends[0]) / (rounds - 1)
    result = dict(per_client_fit_ms=1000 * steady / clients_per_round, startup_s=ends[0] - launched - steady,
                  own_peak_rss_mb=peak_rss_mb())  # fmt: skip
    if inside:  # Flower: the ClientApp's own time, steady state; the rest of a round is messaging and polling
        result["inside_client_ms"] = 1000 * statistics.median(inside[1:])
    return result


def launch(execution: str, rounds: int, clients_per_round: int, actors: int, timeout: float = 600) -> dict:
    """``measure`` in a fresh process, plus ``peak_tree_mb`` of its process tree; on failure ``{"error": one line}``.

    The tree's memory is sampled from here, outside the measured process, so the
    sampling (a scan of ``/proc``, a few ms) takes no time from its rounds.
    """
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    launched = time.time()
    args = [sys.executable, __file__, "--_child", execution, str(rounds), str(clients_per_round), str(actors), repr(launched)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    with PeakTreeMemory(root=proc.pid) as memory:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"error": f"no result within {timeout:.0f} s"}
    results = [line[len("RESULT ") :] for line in stdout.splitlines() if line.startswith("RESULT ")]
    cause = _first_exception(stderr)
    if results:
        result = json.loads(results[-1])
        if "error" in result and cause and cause not in result["error"]:
            result["error"] += f" (first error: {cause})"  # Flower logs the cause and raises a generic error
        return result if "error" in result else {**result, "peak_tree_mb": memory.peak_mb}
    tail = [line for line in stderr.splitlines() if line.strip()]
    return {"error": f"exit {proc.returncode}: {cause or (tail[-1].strip() if tail else 'no output')}"}


def _first_exception(log: str) -> str | None:
    """The first ``SomeError: message`` line of a log (a traceback's last line), if any."""
    match = re.search(r"^(\w+(?:Error|Exception)): (.*)$", log, flags=re.MULTILINE)
    return f"{match.group(1)}: {match.group(2).strip()}" if match else None


def _child(execution: str, rounds: str, clients_per_round: str, actors: str, launched: str) -> None:
    try:
        result = measure(execution, int(rounds), int(clients_per_round), int(actors), float(launched))
    except BaseException as err:  # noqa: BLE001 - run_simulation may sys.exit; report it in one line
        first = str(err).strip().splitlines()
        result = {"error": f"{type(err).__name__}: {first[0] if first else ''}".strip(": ")}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # do not wait for lingering non-daemon threads (Ray's, Flower's)


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Median of every field over a row's successful runs.

    fl-lightning rows get ``flower_over_this``: Flower's median divided by the row's, per
    field (> 1: fl-lightning is faster to fit, faster to start, leaner).
    """
    rows = []
    for execution, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row: dict = {"execution": execution, "runs": len(ok)}
        if ok:
            for key in [k for k in ok[0] if k != "error"]:
                row[key] = round(statistics.median(r[key] for r in ok), 1 if key.endswith("_mb") else 3)
        else:
            row["error"] = next((r["error"] for r in results if "error" in r), "not run")
        rows.append(row)
    flower = next((r for r in rows if r["execution"] == "flower" and "per_client_fit_ms" in r), None)
    for row in rows:
        if flower and row["execution"] != "flower" and "per_client_fit_ms" in row:
            row["flower_over_this"] = {key: round(flower[key] / row[key], 2) for key in ("per_client_fit_ms", "startup_s", "peak_tree_mb")}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flower-actors", type=int, default=1, help="Ray client actors (one CPU each)")
    parser.add_argument("--executions", default=",".join(EXECUTIONS))
    parser.add_argument("--out", default=None, help="default: benchmarks/results/flower-<cpu>-<cores>cpu-<date>.json")
    parser.add_argument("--_child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        _child(*args._child)
        return

    executions = args.executions.split(",")
    runs: dict[str, list[dict]] = {e: [] for e in executions}
    missing = flower_missing() if "flower" in executions else None
    if missing:
        runs["flower"].append({"error": missing})
        print(f"flower: skipped: {missing}", file=sys.stderr)
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for execution in executions:
            if execution == "flower" and (missing or (runs["flower"] and "error" in runs["flower"][-1])):
                continue  # it failed once: it will fail again; say why once
            result = launch(execution, args.rounds, args.clients_per_round, args.flower_actors)
            runs[execution].append(result)
            shown = result.get("error") or " ".join(f"{k}={v:.3f}" for k, v in result.items())
            print(f"  [{repeat + 1}/{args.repeats}] {execution}: {shown}", file=sys.stderr, flush=True)
    rows = summarize(runs)

    spec = WORKLOADS[WORKLOAD]
    workload = dict(name=WORKLOAD, num_clients=spec["num_clients"], clients_per_round=args.clients_per_round,
                    rounds=args.rounds, local_steps=spec["steps"], batch_size=spec["batch"], model="MLP(32, 10, hidden=[64])",
                    flower_actors=args.flower_actors)  # fmt: skip
    print(f"{'execution':10s} {'ms/client fit':>14s} {'start-up s':>11s} {'peak MB':>9s}  Flower / this (fit, start-up, memory)")
    for row in rows:
        if "error" in row:
            print(f"{row['execution']:10s} not measured: {row['error']}")
            continue
        versus = "  " + "  ".join(f"x{v}" for v in row["flower_over_this"].values()) if "flower_over_this" in row else ""
        print(f"{row['execution']:10s} {row['per_client_fit_ms']:14.3f} {row['startup_s']:11.2f} {row['peak_tree_mb']:9.1f}{versus}")
    info = machine()
    print(f"total {time.perf_counter() - started:.0f} s, medians of {args.repeats}, on {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']} (1 thread per process), Python {info['python']}, {info['os']}")  # fmt: skip
    out = Path(args.out or default_out(info, quick=False, prefix="flower"))
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "date": time.strftime("%Y-%m-%d %H:%M"), "workload": workload, "repeats": args.repeats, "rows": rows}
    try:
        import flwr

        record["flwr"] = flwr.__version__
    except ImportError:
        pass
    out.write_text(json.dumps(record, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
