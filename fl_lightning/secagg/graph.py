"""The communication graph of secure aggregation (docs/algorithms.md, (31.3)): classic SecAgg (Bonawitz et al.,
CCS 2017) pairs every two clients; SecAgg+ (Bell et al., CCS 2020) pairs each client with k neighbours only, on a
Harary graph H(n, k) over a random permutation of the clients: placed on a ring in the permuted order, each is
joined to the k/2 nearest on either side (k even; k >= n - 1 is the complete graph)."""

from __future__ import annotations

import torch


def neighbour_graph(n: int, k: int | None, generator: torch.Generator) -> list[set[int]]:
    """Each position's neighbours among ``range(n)``: all others for ``k=None`` or k >= n - 1, else H(n, k) on the
    permutation drawn from ``generator`` (shared by all: the server's round seed)."""
    if k is None or k >= n - 1:
        return [set(range(n)) - {i} for i in range(n)]
    order = torch.randperm(n, generator=generator).tolist()
    neighbours: list[set[int]] = [set() for _ in range(n)]
    for place, client in enumerate(order):
        for step in range(1, k // 2 + 1):
            other = order[(place + step) % n]
            neighbours[client].add(other)
            neighbours[other].add(client)
    return neighbours
