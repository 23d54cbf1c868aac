"""The correlated-noise mechanisms' state per step against the number of rounds (docs/privacy.md, "Without sampling").

For T in ``--rounds`` it prepares ``CorrelatedNoise`` for a cyclic schedule of ``--groups`` groups (banded: b =
``--bands``), draws the noise of all T rounds for a model of ``--dim`` parameters and records the largest state
the mechanism held between two rounds (the vectors its checkpoint writes), the time per round and the time to
compute the banded matrix before training (its optimiser works on a dense T x T matrix once, before the first
round). Banded MF's state is (b - 1) d floats whatever T; the tree's grows as log2 T.

    python benchmarks/correlated_noise_memory.py --rounds 100 2000 --dim 20000
"""

from __future__ import annotations

import argparse
import json
import time

from fl_lightning.core.participation import CyclicParticipation
from fl_lightning.pipeline.correlated_noise import CorrelatedNoise


def state_bytes(noise) -> int:
    return sum(t.numel() * t.element_size() for t in noise.state_dict().values() if t.dim() > 1 or t.numel() > 1)


def measure(mechanism: str, rounds: int, dim: int, groups: int, bands: int) -> dict:
    settings = CorrelatedNoise(mechanism, bands=bands if mechanism == "banded" else None)
    start = time.perf_counter()
    settings.prepare(CyclicParticipation(groups), groups, rounds)
    prepare_s = time.perf_counter() - start
    noise, largest = settings.noise(seed=0, size=dim), 0
    start = time.perf_counter()
    for _ in range(rounds):
        noise.next()
        largest = max(largest, state_bytes(noise))
    step_ms = 1e3 * (time.perf_counter() - start) / rounds
    return {"mechanism": mechanism, "rounds": rounds, "dim": dim, "state_bytes_max": largest, "state_vectors": largest / (8 * dim),
            "prepare_s": round(prepare_s, 3), "step_ms": round(step_ms, 3), "sensitivity": float(settings.sensitivity[-1])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=[100, 2000])
    parser.add_argument("--dim", type=int, default=20_000)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--bands", type=int, default=8)
    parser.add_argument("--mechanisms", nargs="+", default=["banded", "tree_efficient"])
    args = parser.parse_args()
    for mechanism in args.mechanisms:
        for rounds in args.rounds:
            print(json.dumps(measure(mechanism, rounds, args.dim, args.groups, args.bands)))


if __name__ == "__main__":
    main()
