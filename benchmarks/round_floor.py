"""The floor of a Lightning-driven round: what ``Trainer.fit`` costs a step when the step does nothing
but the server optimizer's step (manual optimization, as ``FederatedModule``), and, beside it, the
round budget the speed goals leave.

    python benchmarks/round_floor.py [--steps 2000] [--repeats 3]

A federated round of ``FederatedModule`` is one Lightning training step: the loop's hooks, the
dataloader's next item and a manual ``optimizer.step()`` are paid every round whatever the
executor does. This prints the median milliseconds per step of such an empty round (the medians
over ``--repeats`` fits of ``--steps`` steps each; the first 100 steps are not counted), with the
machine, so that a ratio goal can be read as a budget: at a goal of G times a bare loop whose round
takes T ms, a framework round has T / G ms, of which this floor is gone before any client trains.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import machine  # noqa: E402


def floor_ms(steps: int) -> float:
    """Median ms between consecutive ``training_step`` calls of an empty manual-optimization round."""
    import lightning as L
    import torch

    class Rounds(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from iter(int, 1)  # endless, as RoundPlans

    class EmptyRound(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.weight = torch.nn.Parameter(torch.zeros(64, 32))
            self.started: list[float] = []

        def training_step(self, batch, batch_idx):
            self.started.append(time.perf_counter())
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.weight.grad = torch.ones_like(self.weight)  # a pseudo-gradient, as the server step sets
            optimizer.step()

        def configure_optimizers(self):
            return torch.optim.SGD([self.weight], lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Rounds(), batch_size=None)

    module = EmptyRound()
    trainer = L.Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module)
    gaps = [b - a for a, b in zip(module.started[100:], module.started[101:])]
    return statistics.median(gaps) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    runs = [floor_ms(args.steps) for _ in range(args.repeats)]
    print(json.dumps({"machine": machine(), "empty_round_ms": round(statistics.median(runs), 4), "runs_ms": [round(r, 4) for r in runs]}, indent=1))


if __name__ == "__main__":
    main()
