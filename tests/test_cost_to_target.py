"""Cost-to-target on logged histories with known crossings, and the table cells built from it."""

import tempfile
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from fl_lightning.experiments.history import ACC, BYTES, PER_CLIENT, ROUND, UPLOADS, Cost, History, cost_to_target
from fl_lightning.experiments.tables import cost_cell

# 10 rounds, 4 clients per round, 100 bytes per round, evaluation every 2 rounds
ACCS = {2: 0.2, 4: 0.5, 6: 0.79, 8: 0.8, 10: 0.95}


def history(accs=ACCS, rounds=10, model_bytes=10) -> History:
    rows = ["comm/bytes_total,comm/client_uploads_total,round,step,val/acc"]
    for r in range(1, rounds + 1):
        rows.append(f"{100 * r},{4 * r},{r},{r - 1},")
        if r in accs:
            rows.append(f",,,{r - 1},{accs[r]}")
    path = Path(tempfile.mkdtemp()) / "metrics.csv"
    path.write_text("\n".join(rows) + "\n")
    return History.from_csv(path, model_bytes=model_bytes)


def test_first_evaluation_at_or_above_the_target_is_the_crossing():
    h = history()
    assert cost_to_target(h, 0.8, ROUND) == Cost(True, 8.0)  # 0.79 at round 6 is below; equality counts
    assert cost_to_target(h, 0.8, UPLOADS) == Cost(True, 32.0)
    assert cost_to_target(h, 0.8, BYTES) == Cost(True, 800.0)
    # 800 bytes / 10 bytes per model / 4 clients per round = 20 = 2 messages per client x 8 rounds
    assert cost_to_target(h, 0.8, PER_CLIENT) == Cost(True, 20.0)
    assert cost_to_target(h, 0.1, ROUND) == Cost(True, 2.0)
    assert cost_to_target(h, 0.9, ROUND) == Cost(True, 10.0)


def test_never_reached_returns_the_budget_spent():
    h = history()
    assert cost_to_target(h, 0.96, ROUND) == Cost(False, 10.0)
    assert cost_to_target(h, 0.96, UPLOADS) == Cost(False, 40.0)
    assert h.final(ACC) == 0.95 and h.best(ACC) == 0.95


def test_table_cells_mean_std_and_lower_bounds():
    fast, slow = history(), history({2: 0.3, 4: 0.85, 6: 0.9, 8: 0.9, 10: 0.9})
    never = history({2: 0.1, 4: 0.2, 6: 0.3, 8: 0.4, 10: 0.5})
    # rounds to 0.8: 8 and 4 -> mean 6, sample std sqrt(8)
    assert cost_cell([fast, slow], 0.8, ROUND)[0] == "6.0 ± 2.8"
    assert cost_cell([never, never], 0.8, ROUND)[0] == ">10.0"  # same decimals as the mean ± std cells
    # one of two seeds reached (after 4 rounds), the other spent 10: mean cost > 7
    cell, values = cost_cell([slow, never], 0.8, ROUND)
    assert cell == ">7.0 (1/2)" and values == [(True, 4.0), (False, 10.0)]
    assert cost_cell([fast, fast], 0.8, BYTES)[0] == "0.00 ± 0.00"  # 800 B in MB


@pytest.mark.parametrize("algorithm, per_round", [("FedAvg", 2.0), ("SCAFFOLD", 4.0)])
def test_communication_per_client_counts_model_sized_messages(tmp_path, algorithm, per_round):
    """Table 1 of the parameter-tracking paper: FedAvg sends x down and Δx up (2), SCAFFOLD also c and Δc (4)."""
    import fl_lightning.algorithms as algorithms
    from fl_lightning.experiments.compare import model_bytes
    from tests.conftest import tiny_datamodule, tiny_module, tiny_trainer

    module = tiny_module(getattr(algorithms, algorithm)())
    logger = CSVLogger(tmp_path, name="", version="log")
    tiny_trainer(tmp_path, 3, logger=logger, log_every_n_steps=1).fit(module, datamodule=tiny_datamodule())
    h = History.from_csv(tmp_path / "log" / "metrics.csv", model_bytes=model_bytes(module))
    assert h.series(PER_CLIENT)[2].tolist() == [per_round, 2 * per_round, 3 * per_round]
