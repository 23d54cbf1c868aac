"""A round's results as columns (``RoundResults``): what a stacked round returns and the module reads without a
``ClientResult`` per client; its rows, its merge of stacks into task order, and the stacked readers
(``P.part``, ``weighted_sum``, ``local_consistency``, ``all_finite``) against the same uploads as plain lists."""

import math

import pytest
import torch

import fl_lightning.algorithms as algorithms
from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.reliability.faults import DivergenceError
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer

from fl_lightning.core import params as P
from fl_lightning.core import tasks
from fl_lightning.core.metrics import local_consistency, payload_bytes
from fl_lightning.core.round_results import RoundResults, StackedPayloads, merged
from fl_lightning.core.tasks import ClientResult
from fl_lightning.rounds.round_states import store_results
from fl_lightning.core.state import ClientStore
from fl_lightning.reliability.faults import all_finite
from tests.test_masked_stacking import SCENARIOS, _assert_same, _fit


def _stacked(ids, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = len(ids)
    uploads = {"delta": {"w": torch.randn(s, 3, 2, generator=g), "b": torch.randn(s, 3, generator=g)}, "delta_c": {"w": torch.randn(s, 3, 2, generator=g)}}
    states = {"c": {"w": torch.randn(s, 3, 2, generator=g, dtype=torch.float64)}}
    losses, accs = torch.rand(s, generator=g).tolist(), torch.rand(s, generator=g).tolist()
    terms = {"ce": torch.rand(s, generator=g).tolist(), "prox": torch.rand(s, generator=g).tolist()}
    steps = list(range(1, s + 1))
    return RoundResults.stacked(ids, steps, losses, accs, uploads, states, terms), (uploads, states, losses, accs, terms, steps)


def _rows(ids, columns):
    uploads, states, losses, accs, terms, steps = columns
    return [
        ClientResult(
            c, {n: {k: v[i] for k, v in td.items()} for n, td in uploads.items()}, {n: {k: v[i] for k, v in td.items()} for n, td in states.items()},
            steps[i], losses[i], accs[i], {k: v[i] for k, v in terms.items()},
        )
        for i, c in enumerate(ids)
    ]  # fmt: skip


def _assert_rows_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.client_id, a.num_steps, a.mean_loss, a.accuracy, a.loss_terms) == (b.client_id, b.num_steps, b.mean_loss, b.accuracy, b.loss_terms)
        for tree_a, tree_b in ((a.upload, b.upload), (a.client_state, b.client_state)):
            assert tree_a.keys() == tree_b.keys()
            for n in tree_a:
                assert tree_a[n].keys() == tree_b[n].keys() and all(torch.equal(tree_a[n][k], tree_b[n][k]) for k in tree_a[n])


def test_stacked_results_read_the_same_as_columns_and_as_rows():
    ids = [7, 2, 5, 0]
    results, columns = _stacked(ids)
    rows = RoundResults.of(_rows(ids, columns))
    for read in ("client_ids", "num_steps", "mean_losses", "accuracies", "upload_bytes", "loss_terms"):
        assert getattr(results, read) == getattr(rows, read), read
    assert results.upload_bytes == [payload_bytes(r.upload) for r in rows]
    assert isinstance(results.uploads, StackedPayloads) and results.stacked_states is columns[1]
    _assert_rows_equal(list(results), list(rows))  # made once, from the columns
    assert results.stacked_states is None  # the rows are the results now
    results[1].upload = {"delta": {"w": torch.zeros(3, 2), "b": torch.zeros(3)}}  # a reader replaces one upload
    assert results.uploads[1] is results[1].upload and results.upload_bytes[1] == 36


def test_merged_stacks_come_back_in_task_order_and_rows_where_they_cannot_be_concatenated():
    first, first_columns = _stacked([30, 10], seed=1)  # task positions 2 and 0
    second, second_columns = _stacked([20, 40, 50], seed=2)  # positions 1, 3, 4
    both = merged([([2, 0], first), ([1, 3, 4], second)], 5)
    assert both.stacked_states is not None  # still columns: one concatenation per tensor
    want = [None] * 5
    for positions, columns, ids in (([2, 0], first_columns, [30, 10]), ([1, 3, 4], second_columns, [20, 40, 50])):
        for p, row in zip(positions, _rows(ids, columns)):
            want[p] = row
    _assert_rows_equal(list(both), want)
    odd, _ = _stacked([1, 2], seed=3)
    odd._columns.client_states = {"c": {"w": torch.zeros(2, 4)}}  # another shape: no one tensor holds both
    mixed = merged([([1, 0], odd), ([2, 3, 4], second)], 5)
    assert mixed.stacked_states is None and mixed.client_ids == [2, 1, 20, 40, 50]


def test_stacked_uploads_aggregate_and_measure_as_the_same_uploads_listed(monkeypatch):
    results, (uploads, *_) = _stacked([3, 1, 4, 1 + 8, 5])
    listed = [{n: {k: v[i].clone() for k, v in td.items()} for n, td in uploads.items()} for i in range(5)]
    weights = [0.1, 0.3, 0.2, 0.25, 0.15]
    for stack_limit in (P.STACK_LIMIT, 1):  # small tensors stacked in one op; large ones accumulated in turn
        monkeypatch.setattr(P, "STACK_LIMIT", stack_limit)
        for name in ("delta", "delta_c"):
            got, want = P.weighted_sum(P.part(results.uploads, name), weights), P.weighted_sum(P.part(listed, name), weights)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        assert local_consistency(P.part(results.uploads, "delta")) == local_consistency(P.part(listed, "delta"))
    norms, want = P.row_sq_norms(P.part(results.uploads, "delta")), [float(P.sq_norm(d)) for d in P.part(listed, "delta")]
    assert norms == pytest.approx(want, rel=1e-14) and P.row_sq_norms(P.part(listed, "delta")) == want
    assert isinstance(P.part(results.uploads, "delta"), P.StackedDicts)
    assert len(P.part(results.uploads, "absent", default={})) == 5
    with pytest.raises(KeyError):
        P.part(results.uploads, "absent")
    assert all_finite(results.uploads)
    uploads["delta_c"]["w"][3, 1, 0] = math.nan
    assert not all_finite(results.uploads) and not all_finite(listed[:3] + [{"d": {"w": uploads["delta_c"]["w"][3]}}])


def test_stacked_new_states_are_stored_as_the_same_states_client_by_client():
    results, columns = _stacked([6, 2, 9])
    by_rows, by_columns = ClientStore(), ClientStore()
    store_results(by_rows, _rows([6, 2, 9], columns))
    store_results(by_columns, results)
    assert by_columns.equal(by_rows) and by_columns.client_ids() == [2, 6, 9]


@pytest.mark.parametrize("name", ["FedAvg", "SCAFFOLD", "FedDyn", "FedSAM", "FedAlt"])
@pytest.mark.parametrize("scenario", ["epochs", "stragglers"])
def test_a_stacked_round_makes_no_client_result(tmp_path, monkeypatch, name, scenario):
    """Stacked rounds run columns of tasks and hand the module columns of results: not one ``ClientTask`` or
    ``ClientResult`` is made, and the run equals sequential's. SCAFFOLD's finish reads K: it runs once per K and each
    client takes its own K's rows; FedSAM's and FedAlt's rules are not elementwise: they finish client by client,
    and the outputs are stacked (FedAlt's stacks hold clients of equal K)."""
    made = []
    for kind in (tasks.ClientResult, tasks.ClientTask):  # neither the results nor the tasks, one per client
        monkeypatch.setattr(kind, "__init__", lambda self, *a, _init=kind.__init__, **k: made.append(type(self).__name__) or _init(self, *a, **k))
    local, straggler = SCENARIOS[scenario]
    batched = _fit(tmp_path, name, "batched", local, straggler, rounds=3)
    assert batched.executor.stats["stacked_rounds"] == 3 and not made
    sequential = _fit(tmp_path, name, "sequential", local, straggler, rounds=3)
    assert {"ClientTask", "ClientResult"} <= set(made)  # the counter counts: sequential execution makes them per client
    _assert_same(sequential, batched)


def test_round_tasks_are_columns_whose_tasks_are_made_where_read():
    loaded = []
    shared, own = {"x": {"w": torch.zeros(2)}}, {"x": {"w": torch.ones(1)}}
    columns = tasks.TaskColumns([4, 8, 1, 6], [40, 80, 10, 60], [3, 1, 2, 3])
    round_tasks = tasks.RoundTasks(columns, shared, lambda cid: loaded.append(cid) or cid, load_message_state=lambda cid: -cid, own_broadcasts={2: own})
    assert tasks.task_columns(round_tasks) is columns and not round_tasks.shared_broadcast
    task = round_tasks[2]
    assert (task.client_id, task.seed, task.num_steps, task.broadcast, task.warmup) == (1, 10, 2, own, False)
    assert round_tasks[2] is task and round_tasks[0].broadcast is shared and round_tasks[-1].client_id == 6
    assert task.load_state() == 1 and task.load_message_state() == -1 and loaded == [1]
    chosen = tasks.subset(round_tasks, [3, 2])
    assert tasks.task_columns(chosen) == ([6, 1], [60, 10], [3, 2]) and chosen[1].broadcast is own and chosen[0].broadcast is shared
    assert tasks.shares_broadcast(tasks.subset(round_tasks, [0, 1, 3]))
    listed = list(round_tasks)
    assert tasks.task_columns(listed) == columns and [t.client_id for t in tasks.subset(listed, [1, 0])] == [8, 4]
    assert not tasks.shares_broadcast(listed) and tasks.shares_broadcast(listed[:2])


class _OneClientDiverges(algorithms.FedAvg):
    """Round 2's second client uploads NaN (its finish runs client by client: it reads ctx.client_id)."""

    culprit: list[int] = []

    def client_finish(self, params, local, ctx):
        upload, state = super().client_finish(params, local, ctx)
        if ctx.info.round == 2 and ctx.client_id == int(ctx.info.plan.clients[1]):
            self.culprit.append(ctx.client_id)
            upload["delta"] = {k: v * float("nan") for k, v in upload["delta"].items()}
        return upload, state


def test_a_stacked_rounds_non_finite_upload_is_named_by_its_client(tmp_path):
    module = FederatedModule(MLP(8, 3, hidden=[16]), _OneClientDiverges(), LocalTraining(lr=0.1, steps=2, batch_size=8), execution="batched")
    with pytest.raises(DivergenceError, match="round 2: client (\\d+) sent a non-finite update") as raised:
        tiny_trainer(tmp_path, rounds=4).fit(module, datamodule=tiny_datamodule())
    assert f"client {_OneClientDiverges.culprit[-1]} sent" in str(raised.value)
    assert module.executor.stats["stacked_rounds"] == 3 and not module.executor.fallbacks
