"""Client-store time per round at S clients: load the round's states stacked, write the new ones back.

    python benchmarks/store_tables.py --per-round 200 --clients 1000 --rounds 20

A SCAFFOLD-like state (one control variate per parameter of a ~100k-parameter MLP). The per-client
path is what a batched round did before client state tables (``get`` per client then stack, ``put``
per client's row view); the table path is ``gather`` and ``scatter`` (one indexed op per tensor).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fl_lightning.core.state import ClientStore  # noqa: E402

SHAPES = {"net.0.weight": (256, 64), "net.0.bias": (256,), "net.2.weight": (256, 256), "net.2.bias": (256,), "net.4.weight": (10, 256), "net.4.bias": (10,)}


def init():
    return {"c": {k: torch.zeros(s) for k, s in SHAPES.items()}}


def per_client_round(store, ids):
    states = [store.get(c, init) for c in ids.tolist()]
    stacked = {n: {k: torch.stack([s[n][k] for s in states]) for k in states[0][n]} for n in states[0]}
    new = {n: {k: v + 1 for k, v in td.items()} for n, td in stacked.items()}
    for i, c in enumerate(ids.tolist()):
        store.put(c, {n: {k: v[i] for k, v in td.items()} for n, td in new.items()})


def table_round(store, ids):
    stacked = store.gather(ids, init)
    new = {n: {k: v + 1 for k, v in td.items()} for n, td in stacked.items()}
    store.scatter(ids, new)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--path", choices=["per-client", "table"], default="table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = table_round if args.path == "table" else per_client_round
    store, generator = ClientStore(), torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.rounds):
        ids = torch.randperm(args.clients, generator=generator)[: args.per_round]
        start = time.perf_counter()
        run(store, ids)
        times.append(time.perf_counter() - start)
    steady = sorted(times[args.rounds // 2 :])  # after most clients have a row
    print(json.dumps(dict(path=args.path, clients=args.clients, per_round=args.per_round, stored=len(store),
                          median_ms=round(1000 * steady[len(steady) // 2], 1), first_ms=round(1000 * times[0], 1))))  # fmt: skip


if __name__ == "__main__":
    main()
