"""compare's tables say what they measured: the split (validation / test / client holdout) and the
model (global, personalized; final or best-on-validation evaluation) of every row and heading, a
target table per split, no "± 0.0" for one seed, which differences lie within seed noise, and each
failure once, in its own section."""

import re

import pytest

from fl_lightning.experiments.history import ACC, ROUND, TEST_ACC, UPLOADS, History
from fl_lightning.experiments.labels import METRICS, measured
from fl_lightning.experiments.tables import summary_latex, summary_markdown, summary_tables


def history(val: dict[int, float], test: dict[int, float] | None = None, extra: dict[str, float] | None = None) -> History:
    """Evaluations at the rounds of ``val``; ``test`` at its own rounds (every evaluation, or only the last)."""
    records = []
    for r in range(1, max(val) + 1):
        record = {ROUND: float(r), UPLOADS: 5.0 * r}
        if r in val:
            record[ACC] = val[r]
        if test and r in test:
            record[TEST_ACC] = test[r]
        if extra and r == max(val):
            record.update(extra)
        records.append(record)
    return History(records)


# FedAvg of the issue: the validation accuracy reaches 0.8 at round 25, where the test accuracy is 0.788
FEDAVG_VAL = {5: 0.5, 10: 0.6, 15: 0.7, 20: 0.75, 25: 0.800, 30: 0.82}
FEDAVG_TEST = {5: 0.5, 10: 0.6, 15: 0.7, 20: 0.74, 25: 0.788, 30: 0.81}


def rows(table) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in table.rows}


def test_targets_are_reported_on_validation_and_on_test_separately():
    h = history(FEDAVG_VAL, FEDAVG_TEST)
    accuracy, on_val, on_test = summary_tables({"FedAvg": [h]}, [0], [0.8])
    assert on_val.title == "Cost to reach a target validation accuracy (global model, at each evaluation)"
    assert on_test.title == "Cost to reach a target test accuracy (global model, at each evaluation)"
    assert on_val.header[1] == "Target (validation accuracy)" and on_test.header[1] == "Target (test accuracy)"
    assert rows(on_val)["Total global iterations (rounds)"] == ["0.8", "25.0"]  # credited at val 0.800
    assert rows(on_test)["Total global iterations (rounds)"] == ["0.8", "30.0"]  # test 0.788 < 0.8 at round 25
    assert "Test accuracy, global model, final evaluation (%)" in rows(accuracy)
    assert "Test accuracy, global model, at the best-validation evaluation (%)" in rows(accuracy)
    assert "Validation accuracy, global model, final evaluation (%)" in rows(accuracy)
    assert rows(accuracy)["Test accuracy, global model, final evaluation (%)"] == ["81.0"]
    assert rows(accuracy)["Validation accuracy, global model, final evaluation (%)"] == ["82.0"]


def test_a_test_set_evaluated_only_at_the_end_gives_a_validation_target_table_that_says_so():
    h = history(FEDAVG_VAL, {30: 0.81})
    tables = summary_tables({"FedAvg": [h]}, [0], [0.8])
    assert [t.title for t in tables[1:]] == ["Cost to reach a target validation accuracy (global model, at each evaluation)"]
    assert "test set is evaluated only at the end" in tables[1].note
    accuracy = rows(tables[0])
    assert accuracy["Test accuracy, global model, final evaluation (%)"] == ["81.0"]
    assert not any("best-validation" in row for row in accuracy)  # no test accuracy at the other evaluations
    # a run with one evaluation has the test set at every evaluation: both target tables
    assert len(summary_tables({"FedAvg": [history({30: 0.82}, {30: 0.81})]}, [0], [0.8])) == 3


def test_without_a_validation_split_val_acc_is_labelled_as_the_test_set():
    h = history(FEDAVG_VAL)
    accuracy, cost = summary_tables({"FedAvg": [h]}, [0], [0.8])
    assert list(rows(accuracy))[:2] == [
        "Test accuracy, global model, final evaluation (%)",
        "Test accuracy, global model, best evaluation (selected on the test set) (%)",
    ]
    assert "no validation split" in accuracy.note
    assert cost.title == "Cost to reach a target test accuracy (global model, at each evaluation)"
    assert measured(ACC, validation_split=False) == METRICS[TEST_ACC]


def test_one_seed_prints_no_spread_and_says_so_once():
    md = summary_markdown({"A": [history(FEDAVG_VAL, FEDAVG_TEST)], "B": [history(FEDAVG_VAL, FEDAVG_TEST)]}, [0], [0.8])
    assert "±" not in md
    assert md.count("1 seed, no spread") == 1
    assert "| Test accuracy, global model, final evaluation (%) | 81.0 | 81.0 |" in md


def test_differences_within_seed_noise_are_marked_and_the_rule_is_stated():
    def seeds(*finals):
        return [history({5: 0.5, 10: f}, {5: 0.5, 10: f}) for f in finals]

    # best: 0.90 ± 0.01; near: 0.886 ± 0.006 (gap 1.4 <= 1.0 + 0.6); far: 0.80 ± 0.01 (gap 10 > 2)
    histories = {"near": seeds(0.88, 0.886, 0.892), "best": seeds(0.89, 0.90, 0.91), "far": seeds(0.79, 0.80, 0.81)}
    accuracy = summary_tables(histories, [0, 1, 2], [])[0]
    final = rows(accuracy)["Test accuracy, global model, final evaluation (%)"]
    assert final == ["88.6 ± 0.6 ≈", "**90.0 ± 1.0**", "80.0 ± 1.0"]
    assert "≈: within seed noise of the best" in accuracy.note
    assert "|mean − best mean| ≤ its std + the best's std" in accuracy.note
    assert "\\textbf{90.0 $\\pm$ 1.0}" in summary_latex([accuracy]) and "$\\approx$" in summary_latex([accuracy])
    # fewer rounds is better: the cost row marks the lowest mean
    cost = summary_tables(histories, [0, 1, 2], [0.85])[2]
    assert rows(cost)["Total global iterations (rounds)"] == ["0.85", "**10.0 ± 0.0**", "**10.0 ± 0.0**", ">10.0"]


def test_personalized_metrics_become_labelled_rows_when_logged():
    extra = {"val/personal_acc_mean": 0.91, "val/personal_acc_worst10": 0.5, "test/unseen_acc_mean": 0.7}
    with_extra = history(FEDAVG_VAL, FEDAVG_TEST, extra)
    labels = list(rows(summary_tables({"P": [with_extra]}, [0], [])[0]))
    assert "Personalized accuracy (client holdout, validation half, mean over clients), personalized models, final evaluation (%)" in labels
    assert "Personalized accuracy (client holdout, validation half, worst 10% of clients), personalized models, final evaluation (%)" in labels
    assert any(label.startswith("Unseen-client accuracy at test") for label in labels)
    assert rows(summary_tables({"P": [with_extra]}, [0], [])[0])[METRICS["val/personal_acc_mean"].row("final evaluation")] == ["91.0"]
    plain = list(rows(summary_tables({"P": [history(FEDAVG_VAL, FEDAVG_TEST)]}, [0], [])[0]))
    assert not any("ersonalized" in label or "unseen" in label for label in plain)


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_every_label_names_a_split_and_a_model(metric):
    label = METRICS[metric]
    assert any(split in label.quantity.lower() for split in ("validation", "test", "client-holdout", "client holdout"))
    assert "model" in label.model


def test_failures_are_listed_once_in_their_own_section_and_cells_say_failed():
    ok = history(FEDAVG_VAL, FEDAVG_TEST)
    error = "failed: model.local.lr must be > 0, got -1.0"
    statuses = {"ok": [None, None], "bad": [error, error], "half": [None, "diverged at round 3"]}
    histories = {"ok": [ok, ok], "bad": [History(), History()], "half": [ok, History()]}
    md = summary_markdown(histories, [0, 1], [0.8], statuses=statuses)
    assert md.count("must be > 0") == 1 and md.count("diverged at round 3") == 1
    failures = md.split("## Failures", 1)[1]
    assert "must be > 0" in failures and "seed 1: diverged at round 3" in failures
    final = next(line for line in md.splitlines() if line.startswith("| Test accuracy, global model, final evaluation"))
    assert final.split(" | ")[2] == "failed"
    assert "| Seeds finished | 2/2 | 0/2 | 1/2 |" in md
    assert "## Failures" not in summary_markdown({"ok": [ok, ok]}, [0, 1], [0.8])


def test_a_run_name_holding_a_pipe_stays_one_column():
    md = summary_markdown({"FedAvg|lr=0.1": [history(FEDAVG_VAL, FEDAVG_TEST)], "B": [history(FEDAVG_VAL, FEDAVG_TEST)]}, [0], [0.8])
    header = next(line for line in md.splitlines() if "FedAvg" in line)
    assert "FedAvg\\|lr=0.1" in header
    cells = [c for c in re.split(r"(?<!\\)\|", header)[1:-1]]
    body = next(line for line in md.splitlines() if line.startswith("| Test accuracy, global model, final"))
    assert len(cells) == len(re.split(r"(?<!\\)\|", body)[1:-1]) == 3
