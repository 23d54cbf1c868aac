"""Masked stacking: clients with unequal local work run stacked with sequential execution's results
(docs/performance.md, "Masked stacking"; docs/algorithms.md, E13)."""

import itertools
import math

import pytest
import torch

import fl_lightning.algorithms as algorithms
from datamodules import Dirichlet
from fl_lightning import FederatedModule, LocalTraining
from fl_lightning.core.client_data import IGNORE_TARGET
from fl_lightning.algorithms.base import declares_capability
from fl_lightning.executors import BatchedExecutor
from fl_lightning.executors import masking as M
from fl_lightning.reliability.faults import ClientFaults
from fl_lightning.run.setting_ranges import PROJECT_ALGORITHMS
from models import MLP
from tests.conftest import assert_resumes_bitwise, tiny_datamodule, tiny_trainer

HEAD = ["net.3.weight", "net.3.bias"]  # MLP(8, 3, hidden=[16])'s head: the personal tensors of the methods that keep some
SIZES = [16, 7, 40, 54, 52, 34, 12, 25]  # _data()'s clients: some smaller than a batch of 16, all of 4 rows or more


def _data():
    return tiny_datamodule(num_clients=8, clients_per_round=4, partition=Dirichlet(0.3, min_size=5))


SCENARIOS = {  # local training, stragglers: every one gives clients of a round unequal steps, some unequal batch sizes
    "epochs": (LocalTraining(lr=0.1, steps=None, epochs=2, batch_size=16), 0.3),  # short last batches, short clients
    "stragglers": (LocalTraining(lr=0.1, steps=3, batch_size=4), 0.5),  # equal batches: only steps are masked
    "full_batch": (LocalTraining(lr=0.1, steps=2, batch_size=None), 0.5),  # every client's whole set each step
}
# Rules that may run sequentially, for their declared reason: none. A schedule on ctx.num_steps in the local steps
# (FedAlt) stacks the clients of equal K together; full gradients (FedALA) get the clients' padded whole sets. Local
# losses (MOON, FedNTD, FedLC, FedRS, FedDecorr, FedRoD, FedProto) leave padded rows out (local_loss_ignores_padded_rows)
# and stack in every scenario. FedAvgSVRG needs every client to run snapshots * inner_steps steps (no stragglers, no
# epochs): not swept (tests/test_fedavg_svrg.py).
REASONS: dict[str, str] = {}

def _fit(tmp_path, name, execution, local, straggler, rounds=2):
    torch.manual_seed(0)
    algorithm = getattr(algorithms, name)()
    personal = HEAD if getattr(algorithm, "supports_personal", False) else []
    module = FederatedModule(
        MLP(8, 3, hidden=[16]), algorithm, local, execution=execution, personal=personal,
        faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3),
    )  # fmt: skip
    tiny_trainer(tmp_path, rounds).fit(module, datamodule=_data())
    return module


def _fit_both(tmp_path, make, local, rounds):
    """The same run (``make()``'s algorithm on ``_data()``) batched and sequentially: ``{execution: module}``."""
    runs = {}
    for execution in ("batched", "sequential"):
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), make(), local, execution=execution)
        tiny_trainer(tmp_path, rounds).fit(module, datamodule=_data())
        runs[execution] = module
    return runs


def _assert_same(seq, bat):
    for a, b in zip(seq.model.parameters(), bat.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sa, sb = seq.store.state_dict(), bat.store.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=1e-5)


# docs/algorithms.md, E13: every built-in algorithm, unequal local work
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", [n for n in PROJECT_ALGORITHMS if n != "FedAvgSVRG"])
def test_unequal_local_work_stacked_equals_sequential(tmp_path, name, scenario):
    local, straggler = SCENARIOS[scenario]
    bat = _fit(tmp_path, name, "batched", local, straggler)
    seq = _fit(tmp_path, name, "sequential", local, straggler)
    _assert_same(seq, bat)
    stats, fallbacks = bat.executor.stats, bat.executor.fallbacks
    if fallbacks:
        assert name in REASONS and all(REASONS[name] in reason for reason in fallbacks), fallbacks
        return
    assert stats["rounds"] == stats["stacked_rounds"] == 2
    # eager, an elementwise rule's stack shrinks to the clients still running: stragglers (equal batches) pad nothing;
    # FedLADA's local state holds the broadcast shift, shared by the clients, so its stack keeps every client (masked)
    # FedAlt (ctx.num_steps in its local steps) runs one stack per K: equal batches pad nothing either
    shrinks = declares_capability(getattr(algorithms, name)(), "elementwise") and name != "FedLADA"
    assert (stats["padded_work"] == 0) == (scenario == "stragglers" and (shrinks or name == "FedAlt"))

def test_padded_batches_are_the_sequential_batches_with_masked_padding():
    """Client i's real rows of step k are sequential execution's batch k; padded rows repeat a sample with
    target IGNORE_TARGET; padded steps are False in the step mask."""
    data = _data()
    data.setup()
    clients, seeds, steps = [1, 2, 6], [11, 12, 13], [2, 5, 1]  # sizes 7, 40, 12: 2, 6 and 2 steps in 2 epochs of 16
    padded = data.padded_client_batches(clients, seeds, 16, None, 2, steps)
    batches = list(padded.batches)
    assert (padded.steps, padded.rows) == (5, 16) and len(batches) == 5
    assert padded.step_mask.tolist() == [[k < n for k in range(5)] for n in steps]
    for i, (c, s, n) in enumerate(zip(clients, seeds, steps)):
        sequential = list(itertools.islice(data.client_batches(c, s, 16, None, 2), n))
        for k, (x, y) in enumerate(sequential):
            rows = len(y)
            assert int(padded.real_rows[i, k]) == rows
            assert torch.equal(batches[k][0][i, :rows], x) and torch.equal(batches[k][1][i, :rows], y)
            assert bool((batches[k][1][i, rows:] == IGNORE_TARGET).all())
        assert int(padded.real_rows[i, n:].sum()) == 0
    bucketed = data.padded_client_batches(clients, seeds, 16, None, 2, steps, min_steps=16, min_rows=16)
    assert (bucketed.steps, bucketed.rows) == (16, 16) and len(list(bucketed.batches)) == 16


def test_a_masked_step_keeps_values_even_where_the_discarded_step_is_not_finite():
    old = {"w": torch.ones(3, 2), "state": [torch.zeros(3)]}
    new = {"w": torch.tensor([[float("nan"), 1.0], [2.0, 2.0], [float("inf"), 0.0]]), "state": [torch.full((3,), float("nan"))]}
    kept = M.keep_where(torch.tensor([False, True, False]), new, old)
    assert torch.equal(kept["w"], torch.tensor([[1.0, 1.0], [2.0, 2.0], [1.0, 1.0]]))
    assert torch.equal(kept["state"][0][[0, 2]], torch.zeros(2)) and kept["state"][0][1].isnan()


def test_client_work_counts_the_rows_sequential_execution_draws():
    data = _data()
    data.setup()
    for c, (batch_size, steps, epochs) in itertools.product(range(8), [(16, None, 2), (16, 3, None), (None, 2, None), (5, None, 1)]):
        num_steps = data.num_local_steps(c, batch_size, steps, epochs)
        for k in {1, max(1, num_steps // 2), num_steps}:
            rows = [len(b[-1]) for b in itertools.islice(data.client_batches(c, 3, batch_size, steps, epochs), k)]
            work = M.client_work(SIZES[c], batch_size, steps, epochs, k)
            assert (work.steps, work.rows, work.real) == (k, max(rows), sum(rows))


def test_largest_rows_are_the_largest_client_works():
    """``largest_rows`` (one max over the round's sizes) is the largest ``client_work`` rows, whatever the steps."""
    groups = [[1], [5, 5, 5], [1, 2, 3], [16, 7, 40], [4, 100, 4, 31], SIZES]
    for sizes, batch_size, (steps, epochs), k in itertools.product(groups, [None, 1, 4, 16, 64], [(3, None), (None, 2)], [1, 3, 9]):
        expected = max(M.client_work(n, batch_size, steps, epochs, k).rows for n in sizes)
        assert M.largest_rows(torch.tensor(sizes), batch_size) == expected


def _brute_force_area(works, most):
    """The least total padded area over every split of the (K, B)-sorted clients into at most ``most`` runs."""
    order = sorted(works, key=lambda w: (w.steps, w.rows))
    best = math.inf
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, len(order)), r) for r in range(most)):
        bounds = [0, *cuts, len(order)]
        best = min(best, sum(M.padded_area(order[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_buckets_minimise_the_padded_area_and_keep_one_stack_under_the_cap():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        works = [M.Work(int(k), int(b), int(k) * int(b)) for k, b in torch.randint(1, 30, (7, 2), generator=gen)]
        groups = M.buckets(works, cap=0.0, most=3)
        assert sorted(i for g in groups for i in g) == list(range(7)) and len(groups) <= 3
        assert sum(M.padded_area([works[i] for i in g]) for g in groups) == _brute_force_area(works, 3)
    even = [M.Work(10, 16, 160)] * 3 + [M.Work(8, 16, 128)]
    assert M.buckets(even, cap=0.5, most=4) == [[0, 1, 2, 3]]  # 8% waste: one stack


def test_a_round_wasting_more_than_the_cap_runs_in_buckets_with_the_same_results(tmp_path, stacked_sizes):
    """A rule run per client under vmap (FedSAM's gradient norm; an elementwise rule's stack shrinks instead)."""
    local = LocalTraining(lr=0.1, steps=None, epochs=2, batch_size=8)
    sizes = stacked_sizes
    one = _fit(tmp_path, "FedSAM", BatchedExecutor(max_buckets=1), local, 0.0)
    assert sizes == [4, 4]
    capped = _fit(tmp_path, "FedSAM", BatchedExecutor(max_padding_waste=0.1, max_buckets=3), local, 0.0)
    assert len(sizes) > 4 and sum(sizes[2:]) == 8
    s1, s2 = one.executor.stats, capped.executor.stats
    assert s1["real_work"] == s2["real_work"] and s2["padded_work"] < s1["padded_work"]
    assert s2["stacked_rounds"] == 2
    _assert_same(one, capped)


def test_masked_stacking_off_runs_unequal_rounds_sequentially_bitwise(tmp_path):
    local, straggler = SCENARIOS["epochs"]
    off = _fit(tmp_path, "SCAFFOLD", BatchedExecutor(masked_stacking=False), local, straggler)
    assert off.executor.stats["stacked_rounds"] == 0 and "masked_stacking is false" in next(iter(off.executor.fallbacks))
    seq = _fit(tmp_path, "SCAFFOLD", "sequential", local, straggler)
    assert all(torch.equal(a, b) for a, b in zip(seq.model.parameters(), off.model.parameters()))


@pytest.mark.parametrize(
    "value, setting",
    [(1.0, "max_padding_waste"), (-0.1, "max_padding_waste"), (True, "max_padding_waste"), (0, "max_buckets"), (1, "masked_stacking"),
     (3, "steps_per_call"), (True, "steps_per_call")],
)
def test_padding_settings_are_checked(value, setting):
    with pytest.raises(ValueError, match=f"execution.{setting} must be"):
        BatchedExecutor(**{setting: value})


@pytest.mark.parametrize("compiled", [False, True])
def test_losses_accuracies_and_steps_count_only_real_steps_and_rows(tmp_path, monkeypatch, compiled):
    """Each client's reported mean loss, accuracy and K_i equal sequential execution's (padded steps and rows not
    counted; compiled: the shrinking stack's steps evaluate only the clients still running)."""
    from fl_lightning.executors import SequentialExecutor

    reported = {"batched": [], "sequential": []}
    for cls, key in ((BatchedExecutor, "batched"), (SequentialExecutor, "sequential")):
        original = cls.run

        def spy(self, tasks, info, runtime, _original=original, _key=key):
            results = _original(self, tasks, info, runtime)
            reported[_key] += [(r.client_id, r.mean_loss, r.accuracy, r.num_steps) for r in results]
            return results

        monkeypatch.setattr(cls, "run", spy)
    local, straggler = SCENARIOS["epochs"]
    executor = BatchedExecutor(compile=True, backend="eager") if compiled else BatchedExecutor()
    _fit(tmp_path, "FedAvg", executor, local, straggler)
    assert not executor.fallbacks
    if compiled:
        assert not executor.compile_fallbacks and min(v[1] for v in executor.programs.variants) < 4
    _fit(tmp_path, "FedAvg", "sequential", local, straggler)
    assert [r[0] for r in reported["batched"]] == [r[0] for r in reported["sequential"]]
    assert len({r[3] for r in reported["batched"]}) > 1  # unequal K_i
    for (_, loss_b, acc_b, k_b), (_, loss_s, acc_s, k_s) in zip(reported["batched"], reported["sequential"]):
        assert k_b == k_s and acc_b == pytest.approx(acc_s, abs=1e-6) and loss_b == pytest.approx(loss_s, rel=1e-5)


@pytest.mark.parametrize("name, unit, scenario", [("FedAvg", "round", "stragglers"), ("SCAFFOLD", "step", "epochs")])
def test_compiled_masked_stacking_pads_steps_and_rows_to_powers_of_two(tmp_path, name, unit, scenario):
    """Compiled batched execution pads K and B to powers of two (B at most local.batch_size): a bounded number of
    programs, with sequential eager execution's results."""
    local, straggler = SCENARIOS[scenario]
    executor = BatchedExecutor(compile=True, backend="eager", compile_unit=unit)
    bat = _fit(tmp_path, name, executor, local, straggler)
    _assert_same(_fit(tmp_path, name, "sequential", local, straggler), bat)
    assert not executor.fallbacks and not executor.compile_fallbacks and executor.stats["stacked_rounds"] == 2
    variants = executor.programs.variants
    assert any(masked for *_, masked, _ in variants)
    for steps, _, _, masked, rows in variants:  # a round without padding (every client K steps of B rows) runs as it is
        assert not masked or (rows in (1, 2, 4, 8, 16) and (unit == "step" or steps in (1, 2, 4, 8, 16)))


# docs/algorithms.md, E13, compiled: rules of different shapes (a per-client vmapped rule, optimizer moments, client
# state, personal tensors, a finish reading K_i, local losses over padded rows) through the shrinking compiled stack
@pytest.mark.parametrize("name", ["FedSAM", "FAdamET", "FedDyn", "Ditto", "FedNova", "MOON"])
def test_every_kind_of_rule_through_the_shrinking_compiled_stack_equals_sequential(tmp_path, name):
    local, straggler = SCENARIOS["epochs"]
    executor = BatchedExecutor(compile=True, backend="eager")
    bat = _fit(tmp_path, name, executor, local, straggler)
    _assert_same(_fit(tmp_path, name, "sequential", local, straggler), bat)
    assert executor.stats["stacked_rounds"] == 2 and not executor.fallbacks and not executor.compile_fallbacks
    assert min(v[1] for v in executor.programs.variants) < 4  # the stack shrank


@pytest.mark.parametrize("compiled", [False, True])
def test_a_rule_reading_its_k_in_the_local_steps_stacks_the_clients_of_equal_k(tmp_path, compiled):
    """FedAlt's phase switch at K_i // 2 reads ctx.num_steps in the local steps: each round runs one stack per
    distinct K (no fallback to sequential) with sequential execution's results; compiled execution runs those
    stacks eagerly, for that declared reason."""
    local, straggler = SCENARIOS["epochs"]
    executor = BatchedExecutor(compile=True, backend="eager") if compiled else BatchedExecutor()
    bat = _fit(tmp_path, "FedAlt", executor, local, straggler, rounds=3)
    _assert_same(_fit(tmp_path, "FedAlt", "sequential", local, straggler, rounds=3), bat)
    assert executor.stats["stacked_rounds"] == 3 and not executor.fallbacks and type(bat.algorithm) in executor._equal_steps
    if compiled:
        assert executor.compile_fallbacks and all("ctx.num_steps" in reason for reason in executor.compile_fallbacks)


@pytest.mark.parametrize("name", ["FedAvgSVRG", "FedALA"])
def test_full_gradients_stack_over_the_clients_padded_whole_sets(tmp_path, name):
    """ctx.full_grad stacked: each client's gradient on its whole set (7 to 54 samples, padded to the largest with
    masked rows), in FedAvg-SVRG's snapshot steps and FedALA's client_init, equals sequential execution's; every round
    stacked (the first runs again once the rule is found to read full gradients)."""
    make = (lambda: algorithms.FedAvgSVRG(snapshots=2, inner_steps=2)) if name == "FedAvgSVRG" else algorithms.FedALA
    runs = _fit_both(tmp_path, make, LocalTraining(lr=0.1, steps=4, batch_size=4), rounds=3)
    _assert_same(runs["sequential"], runs["batched"])
    executor = runs["batched"].executor.inner
    assert executor.stats["rounds"] == executor.stats["stacked_rounds"] == 3 and not executor.fallbacks
    assert type(runs["batched"].algorithm) in executor._full_gradients


@pytest.mark.parametrize("scenario", ["stragglers", "epochs"])
def test_compiled_auto_unit_runs_every_masked_round_with_one_step_program(tmp_path, scenario):
    """compile_unit auto (the default): a round of unequal work runs as one stack in decreasing K, rows padded to
    local.batch_size, by the step program, whose variant does not depend on K; the stack shrinks to the next power of
    two of the clients still running (one program per size, the same for every round); sequential's results."""
    local, straggler = SCENARIOS[scenario]
    executor = BatchedExecutor(compile=True, backend="eager")
    bat = _fit(tmp_path, "SCAFFOLD", executor, local, straggler)
    _assert_same(_fit(tmp_path, "SCAFFOLD", "sequential", local, straggler), bat)
    assert not executor.fallbacks and not executor.compile_fallbacks and executor.stats["stacked_rounds"] == 2
    masked = [v for v in executor.programs.variants if v[3]]
    assert masked and all(v[0] == "step" and v[4] == local.batch_size for v in masked)
    assert len({v[2:] for v in masked}) == 1 and {v[1] for v in masked} == {1, 2, 4}  # the ladder, compiled at the first round
    stats = executor.stats  # padding counted as computed: less than the full stack of every step would be
    assert 0 < stats["padded_work"] < stats["real_work"] + stats["padded_work"]


@pytest.mark.parametrize("name", ["FedSAM", "MOON"])
def test_two_steps_a_call_equal_sequential_execution(tmp_path, name):
    """steps_per_call=2 over local epochs and stragglers: a rule run per client under vmap (FedSAM) and a local loss
    with client state (MOON) equal sequential execution, every round stacked, the pair program called (an elementwise
    rule with client state: SCAFFOLD, below)."""
    from fl_lightning.executors.compiled import stacked_two_steps

    local, straggler = SCENARIOS["epochs"]
    executor, calls = BatchedExecutor(compile=True, backend="eager", steps_per_call=2), []
    guarded = executor.programs._guarded
    executor.programs._guarded = lambda unit_fn, *a: calls.append(unit_fn) or guarded(unit_fn, *a)
    bat = _fit(tmp_path, name, executor, local, straggler)
    _assert_same(_fit(tmp_path, name, "sequential", local, straggler), bat)
    assert executor.stats["stacked_rounds"] == 2 and not executor.compile_fallbacks and stacked_two_steps in calls


def test_pairs_of_steps_run_where_two_consecutive_steps_keep_the_stack():
    """Hand-worked: sizes (4, 4, 4, 1, 1) run steps 0-1 as a pair, step 2 alone, steps 3-4 as a pair."""
    from fl_lightning.executors.compiled import pair_steps

    sizes, k, calls = [4, 4, 4, 1, 1], 0, []
    while k < len(sizes):
        calls.append((k, k + 1) if pair_steps(sizes, len(sizes), k) else (k,))
        k += len(calls[-1])
    assert calls == [(0, 1), (2,), (3, 4)]
    assert not pair_steps([4, 2], 2, 0) and pair_steps(None, 3, 1) and not pair_steps(None, 3, 2)


def test_compiled_masked_rounds_call_one_program_per_pair_of_steps_with_sequentials_results(tmp_path, monkeypatch):
    """steps_per_call=2: one call per pair of consecutive steps of the same stack size, one per step left over (each
    call pays dynamo's entry), the ladder compiled for both at the first round; sequential execution's results."""
    from fl_lightning.executors import batched as B
    from fl_lightning.executors.compiled import stacked_one_step, stacked_two_steps

    local, straggler = SCENARIOS["epochs"]
    seen, calls = [], []
    sizes_of = B.M.stack_sizes
    monkeypatch.setattr(B.M, "stack_sizes", lambda *a, **k: seen.append(sizes_of(*a, **k)) or seen[-1])
    executor = BatchedExecutor(compile=True, backend="eager", steps_per_call=2)
    guarded = executor.programs._guarded
    monkeypatch.setattr(executor.programs, "_guarded", lambda unit_fn, *a: calls.append(unit_fn) or guarded(unit_fn, *a))
    bat = _fit(tmp_path, "SCAFFOLD", executor, local, straggler, rounds=3)
    _assert_same(_fit(tmp_path, "SCAFFOLD", "sequential", local, straggler, rounds=3), bat)
    assert executor.stats["stacked_rounds"] == 3 and not executor.compile_fallbacks
    masked = [v for v in executor.programs.variants if v[3]]
    assert {v[1] for v in masked if v[0] == "step"} == {v[1] for v in masked if v[0] == "pair"}  # the ladder, for both
    warm = len(masked)  # the first round compiles the ladder, pairs included
    pairs = [len(list(run)) // 2 for sizes in seen for _, run in itertools.groupby(sizes)]
    singles = [len(list(run)) % 2 for sizes in seen for _, run in itertools.groupby(sizes)]
    assert sum(pairs) > 0 and calls.count(stacked_two_steps) == sum(pairs) + warm // 2
    assert calls.count(stacked_one_step) == sum(singles) + warm // 2


def test_a_stack_in_decreasing_k_shrinks_to_the_clients_still_running():
    """Hand-worked: K = (5, 3, 3, 1) stacked as 4: steps 0..4 run 4, 3, 3, 1, 1 clients; buckets of powers of two."""
    assert M.stack_sizes([5, 3, 3, 1], 4) == [4, 4, 4, 1, 1]
    assert M.stack_sizes([5, 3, 3, 1], 4, bucket=lambda n: n) == [4, 3, 3, 1, 1]
    assert M.stack_sizes([5, 3, 3, 1], 8) == [4, 4, 4, 1, 1]  # compiled padding (8 for 4 clients) is shed at once
    assert M.stack_sizes([3, 5], 2) is None  # not in decreasing K: the running clients are not a prefix
    assert M.stack_sizes([2, 2], 2) == [2, 2]


def test_a_shrinking_stack_sets_the_finished_clients_aside_and_joins_them_back_in_order():
    """Hand-worked: 4 clients of K = (3, 2, 1, 1) run 4, 2, 1 at steps 0, 1, 2; each step adds 1 to the running
    rows of what it carries, so client i ends with its own K_i added, in its own row."""
    stack = M.ShrinkingStack(M.stack_sizes([3, 2, 1, 1], 4, bucket=lambda n: n), 4)
    carried, ids = {"w": torch.zeros(4, 2)}, torch.arange(4)
    for step in range(3):
        cut = stack.shrink(step, carried, ids)
        assert (cut is None) == (step == 0)
        if cut is not None:
            carried, ids = cut
        assert ids.tolist() == list(range(stack.running)) and stack.rows(torch.arange(4)).tolist() == ids.tolist()
        carried = {"w": carried["w"] + 1}
    assert stack.joined(carried)["w"].tolist() == [[3.0, 3.0], [2.0, 2.0], [1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("variant", ["eager", "compiled", "moon"])
def test_the_masked_stacking_config_stacks_every_round_through_the_cli(tmp_path, monkeypatch, capsys, variant):
    """``fl-lightning fit --config configs/masked_stacking_digits.yaml``: Dirichlet(0.1) clients, 2 local epochs of
    batch 32, 20% stragglers; every round runs stacked, and the result line reports the stacking (compiled: the
    shrinking stack's step programs, none of them falling back; MOON: a local loss over padded rows)."""
    from pathlib import Path

    from fl_lightning.commands.cli import build_cli

    monkeypatch.chdir(tmp_path)
    compiled = variant == "compiled"
    config = Path(__file__).resolve().parents[1] / "configs" / "masked_stacking_digits.yaml"
    extra = {"eager": [], "compiled": ["--model.execution.init_args.compile", "true", "--model.execution.init_args.backend", "eager"],
             "moon": ["--model.algorithm", "fl_lightning.algorithms.MOON", "--model.algorithm.init_args.mu", "1.0"]}[variant]  # fmt: skip
    cli = build_cli(["fit", "--config", str(config), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                     "--trainer.enable_progress_bar", "false", *extra])  # fmt: skip
    assert type(cli.model.algorithm).__name__ == ("MOON" if variant == "moon" else "FedAvg")
    stats = cli.model.executor.stats
    if compiled:
        batched = cli.model.executor.inner  # the CLI's executor wraps the batched one (DDP-ready)
        assert not batched.compile_fallbacks and len({v[1] for v in batched.programs.variants}) > 1
    assert stats["rounds"] == stats["stacked_rounds"] == 3 and 0 < stats["padded_work"] < stats["real_work"]
    assert not cli.model.executor.fallbacks
    assert "3 of 3 rounds stacked" in capsys.readouterr().out


class _NoisyData(type(_data())):
    """Per-client, per-round input noise drawn from the augment generator (augmented batches)."""

    def augment(self, batch, client_id, generator):
        x, y = batch
        return x + 0.1 * torch.randn(x.shape, generator=generator) + client_id, y


def test_augmented_padded_batches_are_drawn_as_sequential_execution_draws_them(tmp_path):
    local, straggler = SCENARIOS["epochs"]
    data = lambda: _NoisyData(  # noqa: E731
        dataset="synthetic", dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1}, num_clients=8,
        partition=Dirichlet(0.3, min_size=5), participation=tiny_datamodule().participation,
    )  # fmt: skip
    runs = {}
    for execution in ("batched", "sequential"):
        torch.manual_seed(0)
        module = FederatedModule(MLP(8, 3, hidden=[16]), algorithms.FedAvg(), local, execution=execution,
                                 faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3))  # fmt: skip
        tiny_trainer(tmp_path, 2).fit(module, datamodule=data())
        runs[execution] = module
    assert runs["batched"].executor.stats["stacked_rounds"] == 2
    _assert_same(runs["sequential"], runs["batched"])
    plain = _fit(tmp_path, "FedAvg", "sequential", local, straggler)
    assert not torch.allclose(next(plain.model.parameters()), next(runs["batched"].model.parameters()))


@pytest.mark.parametrize("augmented", [False, True])
def test_padded_batches_cut_to_the_running_clients_are_the_whole_batches_leading_clients(augmented):
    """``PaddedBatches.leading(sizes)``: step k's batch is the first min(S, sizes[k]) clients of the whole step k
    batch (augmented data: each client's batches drawn from its own generator as before)."""
    data = _NoisyData(
        dataset="synthetic", dataset_args={"num_samples": 300, "num_features": 8, "num_classes": 3, "seed": 1}, num_clients=8,
        partition=Dirichlet(0.3, min_size=5), participation=tiny_datamodule().participation,
    ) if augmented else _data()  # fmt: skip
    data.setup()
    clients, seeds, steps = [2, 3, 6, 1], [11, 12, 13, 14], [6, 4, 2, 1]  # decreasing K, as a shrinking stack orders them
    sizes = M.stack_sizes(steps, 4, bucket=int)
    padded = data.padded_client_batches(clients, seeds, 16, None, 2, steps)
    whole, cut = list(padded.batches), list(padded.leading(sizes))
    assert sizes == [4, 3, 2, 2, 1, 1] and len(cut) == len(whole) == 6
    for k, (full, part) in enumerate(zip(whole, cut)):
        assert all(len(t) == sizes[k] for t in part)
        assert all(torch.equal(a[: sizes[k]], b) for a, b in zip(full, part))
    assert [len(b[-1]) for b in padded.leading([8] * 6)] == [4] * 6  # compiled buckets above S: every client


@pytest.mark.parametrize("compiled", [False, True])
def test_a_shrinking_stack_gathers_only_its_running_clients_rows(tmp_path, monkeypatch, compiled):
    """Eager and compiled (from the round after the step program first ran) shrinking stacks draw each step's
    batch for its running clients only, with sequential execution's results."""
    from datamodules import FederatedDataModule

    drawn = []  # the clients of each step batch a stack read through ``leading``
    original = FederatedDataModule.padded_client_batches

    def spy(self, *args, **kwargs):
        padded = original(self, *args, **kwargs)
        leading = padded.leading

        def counted(sizes):
            for batch in leading(sizes):
                drawn.append((len(batch[-1]), len(args[0])))
                yield batch

        padded.leading = counted
        return padded

    monkeypatch.setattr(FederatedDataModule, "padded_client_batches", spy)
    local, straggler = SCENARIOS["epochs"]
    executor = BatchedExecutor(compile=True, backend="eager") if compiled else BatchedExecutor()
    bat = _fit(tmp_path, "FedAvg", executor, local, straggler, rounds=3)
    assert not executor.fallbacks and not executor.compile_fallbacks and executor.stats["stacked_rounds"] == 3
    assert drawn and any(running < clients for running, clients in drawn)
    _assert_same(_fit(tmp_path, "FedAvg", "sequential", local, straggler, rounds=3), bat)


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_shrinking_compiled_rounds_resume_bitwise_with_dropout(tmp_path, steps_per_call):
    """4 rounds straight == 2 rounds + checkpoint + a fresh executor resumed to 4, local epochs and stragglers under
    compiled batched execution with dropout: the resumed run compiles its ladder of stack sizes at its first round
    (the straight run at round 0), and that warm-up leaves the random state as it found it (the pair program's too)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    local, straggler = SCENARIOS["epochs"]

    def run(directory, rounds, ckpt=None):
        checkpoint = ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_train_steps=1, save_top_k=0)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        executor = BatchedExecutor(compile=True, backend="eager", steps_per_call=steps_per_call)
        module = FederatedModule(model, algorithms.FedAvg(), local, execution=executor, faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3))
        trainer = tiny_trainer(directory, rounds, enable_checkpointing=True, callbacks=[checkpoint])
        trainer.fit(module, datamodule=_data(), ckpt_path=ckpt)
        assert not executor.fallbacks and not executor.compile_fallbacks
        return module

    assert_resumes_bitwise(run, tmp_path, min_clients=0)  # FedAvg keeps no client state


def test_batch_norm_over_real_rows_is_batch_norm_of_the_real_rows_alone():
    """(29.4) against ``F.batch_norm`` on the real rows only, in float64: outputs and the gradients of a loss that
    reads the real rows (inputs, weight, bias); BatchNorm1d- and 2d-shaped inputs, a row of token targets padding."""
    from fl_lightning.core.real_rows_norm import masked_batch_norm, real_rows

    g = torch.Generator().manual_seed(0)
    for shape in [(6, 5), (6, 3, 4, 4)]:
        x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True)
        target = torch.tensor([2, IGNORE_TARGET, 0, 1, IGNORE_TARGET, 1])
        real = real_rows(target)
        assert real.tolist() == [True, False, True, True, False, True]
        assert real_rows(torch.tensor([[1, IGNORE_TARGET], [IGNORE_TARGET, IGNORE_TARGET]])).tolist() == [True, False]
        ours = masked_batch_norm(x, real, weight, bias, 1e-5)[real]
        reference = torch.nn.functional.batch_norm(x[real], None, None, weight, bias, training=True, eps=1e-5)
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
        probe = torch.randn(reference.shape, generator=g, dtype=torch.float64)
        mine = torch.autograd.grad((ours * probe).sum(), (x, weight, bias))
        theirs = torch.autograd.grad((reference * probe).sum(), (x, weight, bias))
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert float(mine[0][~real].abs().max()) == 0.0  # a padded row changes nothing


class _NormMLP(torch.nn.Sequential):
    """Linear - BatchNorm1d (batch statistics, no running statistics) - ReLU - Linear."""

    def __init__(self):
        super().__init__(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16, track_running_stats=False), torch.nn.ReLU(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("name,personal,compiled", [("FedAvg", [], False), ("FedSAM", [], False), ("FedSim", ["1.weight", "1.bias"], False),
                                                    ("FedNTD", [], False), ("FedAvg", [], True)],
                         ids=["fedavg", "fedsam_vmapped", "fedbn", "fedntd_local_loss", "fedavg_compiled"])  # fmt: skip
def test_batch_norm_models_stack_padded_rows_as_sequential_execution_trains_them(tmp_path, name, personal, compiled):
    """BatchNorm with batch statistics on clients' padded batches (local epochs: short last batches, clients smaller than a
    batch, stragglers): every round runs stacked, its statistics over each client's real rows, and equals sequential
    execution; FedBN is FedSim with the norm layers personal; FedNTD's local loss evaluates the global model too."""
    local, straggler = SCENARIOS["epochs"]
    runs = {}
    for execution in ("sequential", "batched"):
        torch.manual_seed(0)
        executor = BatchedExecutor(compile=True, backend="eager") if compiled and execution == "batched" else execution
        module = FederatedModule(_NormMLP(), getattr(algorithms, name)(), local, execution=executor, personal=personal,
                                 faults=ClientFaults(straggler=straggler, straggler_min_fraction=0.3))  # fmt: skip
        tiny_trainer(tmp_path, 2).fit(module, datamodule=_data())
        runs[execution] = module
    stats = runs["batched"].executor.stats
    assert not runs["batched"].executor.fallbacks and stats["stacked_rounds"] == 2 and stats["padded_work"] > 0
    if compiled:
        assert not runs["batched"].executor.inner.compile_fallbacks
    _assert_same(runs["sequential"], runs["batched"])


class _MeanSquaredALA(algorithms.FedALA):
    """FedALA with a local loss that averages over every row, padded ones included (no declaration)."""

    def local_loss(self, out, target, ctx):
        return {"squared_logits": out.logits.square().mean()}


def test_full_gradients_refuse_a_local_loss_over_padded_rows(tmp_path):
    """Clients of unequal size pad their whole sets; a local loss that does not leave padded rows out would take them
    into ctx.full_grad: the rounds run sequentially for that declared reason (sequential execution's results)."""
    runs = _fit_both(tmp_path, _MeanSquaredALA, LocalTraining(lr=0.1, steps=2, batch_size=4), rounds=2)  # equal batches: only the whole sets are padded
    _assert_same(runs["sequential"], runs["batched"])
    fallbacks = runs["batched"].executor.inner.fallbacks
    assert fallbacks and all("local_loss reduces over the batch's rows" in reason for reason in fallbacks), fallbacks


def test_padded_full_batches_mask_only_where_rows_are_padded():
    """Whole sets of unequal size: padded rows repeat the first sample with target IGNORE_TARGET; of equal size:
    stacked as they are, float (regression) targets too; unequal float targets cannot carry the mask."""
    a, b = (torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 2])), (torch.ones(1, 2), torch.tensor([2]))
    x, y = M.padded_full_batches([a, b])
    assert torch.equal(x[1], torch.ones(3, 2)) and y.tolist() == [[0, 1, 2], [2, IGNORE_TARGET, IGNORE_TARGET]]
    regression = [(torch.ones(2, 1), torch.zeros(2)), (torch.zeros(2, 1), torch.ones(2))]
    assert [t.shape for t in M.padded_full_batches(regression)] == [(2, 2, 1), (2, 2)]
    with pytest.raises(M.Unmaskable, match="integer class targets"):
        M.padded_full_batches([regression[0], (torch.ones(1, 1), torch.ones(1))])


@pytest.mark.parametrize("config, extra", [
    ("svrg_least_squares.yaml", []),  # FedAvg-SVRG's snapshots; regression targets, clients of equal size: nothing padded
    ("pfl_fedala_digits.yaml", ["--model.local.steps", "null", "--model.local.epochs", "1"]),  # Dirichlet clients: padded
], ids=["fedavg_svrg", "fedala_epochs"])  # fmt: skip
def test_full_gradient_configs_stack_every_round_through_the_cli(tmp_path, monkeypatch, config, extra):
    """The FedAvg-SVRG and FedALA configs batched from the CLI: every round stacked with the clients' whole sets, the
    global model of the same config run sequentially (float tolerance)."""
    from pathlib import Path

    from fl_lightning.commands.cli import build_cli

    path = Path(__file__).resolve().parents[1] / "configs" / config
    models = {}
    for execution in ("batched", "sequential"):
        monkeypatch.chdir(tmp_path / execution if (tmp_path / execution).mkdir() is None else tmp_path)
        cli = build_cli(["fit", "--config", str(path), "--model.execution", execution, *extra, "--trainer.max_steps", "3",
                         "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"])  # fmt: skip
        models[execution] = cli.model
    stats = models["batched"].executor.stats
    assert stats["rounds"] == stats["stacked_rounds"] > 0 and not models["batched"].executor.fallbacks
    for a, b in zip(models["sequential"].model.parameters(), models["batched"].model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fedbn_config_stacks_padded_rounds_through_the_cli(tmp_path, monkeypatch):
    """``fl-lightning fit --config configs/pfl_fedbn_digits.yaml`` batched with one local epoch (Dirichlet(0.1) clients:
    short last batches): every round runs stacked over padded rows, its BatchNorm over each client's real rows."""
    from pathlib import Path

    from fl_lightning.commands.cli import build_cli

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "pfl_fedbn_digits.yaml"
    cli = build_cli(["fit", "--config", str(config), "--model.execution", "batched", "--model.local.steps", "null",
                     "--model.local.epochs", "1", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                     "--trainer.enable_progress_bar", "false"])  # fmt: skip
    stats = cli.model.executor.stats
    assert cli.model.objective.batch_norms.layers and not cli.model.objective.batch_norms.installed
    assert stats["rounds"] == stats["stacked_rounds"] == 2 and stats["padded_work"] > 0 and not cli.model.executor.fallbacks
