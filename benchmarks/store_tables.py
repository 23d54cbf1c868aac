"""Client-store time per round at S clients: load the round's states stacked, write the new ones back.

    python benchmarks/store_tables.py --per-round 200 --clients 1000 --rounds 20

A SCAFFOLD-like state (one control variate per parameter of an MLP 64-width-width-10). The per-client
path is what a batched round did before client state tables (``get`` per client then stack, ``put``
per client's row view); the table path is ``gather`` and ``scatter`` (one indexed op per tensor); the results
path writes back as a batched round does (``store_results``: the clients' results' views, one ``scatter``).
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

SHAPES: dict[str, tuple[int, ...]] = {}


def mlp_shapes(width: int) -> dict[str, tuple[int, ...]]:
    """An MLP 64-width-width-10's parameter shapes."""
    return {"net.0.weight": (width, 64), "net.0.bias": (width,), "net.2.weight": (width, width), "net.2.bias": (width,),
            "net.4.weight": (10, width), "net.4.bias": (10,)}  # fmt: skip


def init():
    return {"c": {k: torch.zeros(s) for k, s in SHAPES.items()}}


def per_client_load(store, ids):
    states = [store.get(c, init) for c in ids.tolist()]
    return {n: {k: torch.stack([s[n][k] for s in states]) for k in states[0][n]} for n in states[0]}


def per_client_write(store, ids, new):
    rows = {n: {k: v.unbind(0) for k, v in td.items()} for n, td in new.items()}  # the round's views of each client
    for i, c in enumerate(ids.tolist()):
        store.put(c, {n: {k: v[i] for k, v in td.items()} for n, td in rows.items()})


def table_load(store, ids):
    return store.gather(ids, init)


def table_write(store, ids, new):
    store.scatter(ids, new)


def results_write(store, ids, new):
    """As a batched round writes back: each client's result holds its views of the round's stacked state."""
    from fl_lightning.core.tasks import ClientResult
    from fl_lightning.rounds.round_states import store_results

    rows = {n: {k: v.unbind(0) for k, v in td.items()} for n, td in new.items()}
    results = [ClientResult(c, {}, {n: {k: v[i] for k, v in td.items()} for n, td in rows.items()}, 1, 0.0) for i, c in enumerate(ids.tolist())]
    store_results(store, results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--path", choices=["per-client", "table", "results"], default="table")
    parser.add_argument("--width", type=int, default=256, help="hidden width: 256 ~ 84k parameters, 16 ~ 1.6k")
    args = parser.parse_args()
    SHAPES.update(mlp_shapes(args.width))
    torch.set_num_threads(1)
    load, write = {"table": (table_load, table_write), "results": (table_load, results_write), "per-client": (per_client_load, per_client_write)}[args.path]
    store, generator = ClientStore(), torch.Generator().manual_seed(0)
    loads, writes = [], []
    for _ in range(args.rounds):
        ids = torch.randperm(args.clients, generator=generator)[: args.per_round]
        start = time.perf_counter()
        stacked = load(store, ids)
        loads.append(time.perf_counter() - start)
        new = {n: {k: v + 1 for k, v in td.items()} for n, td in stacked.items()}  # the round (not timed)
        start = time.perf_counter()
        write(store, ids, new)
        writes.append(time.perf_counter() - start)

    def median_ms(times):  # the second half: most clients hold a row by then
        steady = sorted(times[args.rounds // 2 :])
        return round(1000 * steady[len(steady) // 2], 1)

    print(json.dumps(dict(path=args.path, width=args.width, clients=args.clients, per_round=args.per_round, stored=len(store),
                          load_ms=median_ms(loads), write_ms=median_ms(writes))))  # fmt: skip


if __name__ == "__main__":
    main()
