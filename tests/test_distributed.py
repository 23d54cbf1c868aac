"""Clients split over 2 DDP processes (gloo, CPU) give the one-process global model,
server state and client store: bitwise where uploads are gathered, to float tolerance
where an algorithm's linear aggregate is computed from all-reduced partial sums."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_lightning import algorithms as A
from fl_lightning.algorithms.base import declares_capability
from fl_lightning.executors.distributed import assign_clients
from fl_lightning.core.metrics import consistency_from_sums, payload_bytes, round_metrics

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path, devices: int, algorithm: str, skew: bool, *extra: str) -> dict:
    """The script's run on ``devices`` processes; the one-process reference runs in this process (the same script,
    without a second interpreter's imports), the DDP run as users launch it."""
    out = tmp_path / f"{algorithm}_devices{devices}.pt"
    script = ROOT / "benchmarks" / "ddp_check.py"
    args = ["--devices", str(devices), "--rounds", "3", "--clients-per-round", "5", "--algorithm", algorithm,
            "--out", str(out)] + ["--skew"] * skew + list(extra)  # fmt: skip
    if devices == 1:
        threads, argv, cwd = torch.get_num_threads(), sys.argv, os.getcwd()
        try:
            sys.argv = [str(script), *args]
            os.chdir(tmp_path)  # what the run writes (robust_kept.csv) lands where the subprocess's would
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = argv
            os.chdir(cwd)
            torch.set_num_threads(threads)
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, str(script), *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _assert_close(single: dict, ddp: dict, rtol: float, atol: float) -> None:
    for a, b in zip(single["params"], ddp["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for key in ("server_state", "store"):
        assert single[key].keys() == ddp[key].keys()
        for name in single[key]:
            torch.testing.assert_close(single[key][name], ddp[key][name], rtol=rtol, atol=atol)


# docs/algorithms.md, E13
@pytest.mark.parametrize(
    "algorithm, skew",
    [
        ("fadam_et", False),  # only the tracking subset uploads y_delta: results of two structures
        ("scaffold_p", False),  # the warm-up pass split over the ranks; personal tensors as client state
        ("fedfv", False),  # FedFV: every update and loss gathered, tau = 2 rounds of past updates in the server state
        ("fedmgda", False),  # FedMGDA+: the min-norm weights of every normalised update
    ],
)
def test_ddp_two_processes_equal_one_process(tmp_path, algorithm, skew):
    """Algorithms whose aggregate is not declared linear gather every upload: bitwise the one-process run."""
    single, ddp = _train(tmp_path, 1, algorithm, skew), _train(tmp_path, 2, algorithm, skew)
    _assert_close(single, ddp, rtol=0, atol=1e-7)
    if algorithm == "fedfv":  # no client state: the past updates are the server's
        assert single["server_state"], "the check must compare FedFV's history"
    elif algorithm != "fedmgda":
        assert single["store"], "the check must compare some client state"
    assert ddp["exchanges"] == {"gathered": 3 + (algorithm == "scaffold_p"), "summed": 0}  # + the warm-up pass


def test_ddp_robust_aggregation_gathers_and_equals_one_process(tmp_path):
    """Multi-Krum needs every upload in one place: the processes gather them (never the partial sums), and
    2 processes give the one-process run bitwise, SCAFFOLD's control deltas combined jointly."""
    single = _train(tmp_path, 1, "scaffold", False, "--robust", "multi_krum", "1")
    ddp = _train(tmp_path, 2, "scaffold", False, "--robust", "multi_krum", "1")
    _assert_close(single, ddp, rtol=0, atol=0)
    assert ddp["exchanges"] == {"gathered": 3, "summed": 0}
    assert single["metrics"]["robust/kept_fraction"] == ddp["metrics"]["robust/kept_fraction"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "algorithm, skew, extra",
    [
        ("fedavg", False, ()),
        ("scaffold", True, ()),  # client state; unequal local steps, so the ranks get unequal client counts
        ("fedavg", False, ("--dropout", "0.4")),  # dropped clients: the survivors are reweighted
        ("fedavg_fail_first", False, ()),  # a client fails while training: the ranks sum again with new weights
        ("fedavg", False, ("--bernoulli", "0.02")),  # weights 1/(N p); 0 to 4 clients a round, a rank may have none
        ("ditto", True, ()),  # a whole personal model per client (client state), FedAvg's summed uploads
        ("fedproto", False, ()),  # no model delta: per-class prototype sums, a data pass per client
        ("qffl", True, ()),  # q-FFL: the sums of F_k^q d_k and of h_k (a number per client), a data pass per client
        ("term", False, ()),  # TERM: the sums of e^{t F_k} d_k and of e^{t F_k}
        ("afl", True, ()),  # AFL: per-domain sums of n_k F_k and n_k beside the lambda-weighted updates
    ],
)
def test_ddp_partial_sums_equal_one_process(tmp_path, algorithm, skew, extra):
    """A linear aggregate from all-reduced partial sums: the one-process run to float tolerance
    (the summation order differs), the round's metrics included, comm/* exactly."""
    single, ddp = _train(tmp_path, 1, algorithm, skew, *extra), _train(tmp_path, 2, algorithm, skew, *extra)
    _assert_close(single, ddp, rtol=1e-5, atol=1e-6)
    assert ddp["exchanges"] == {"gathered": 0, "summed": 3}, "the partial-sum path must have run"
    assert single["exchanges"] == {"gathered": 0, "summed": 0}
    assert single["metrics"].keys() == ddp["metrics"].keys()
    for name, value in single["metrics"].items():
        if name.startswith(("comm/", "train/clients", "faults/")):
            assert ddp["metrics"][name] == value, name
        elif name != "time/round_s":
            assert ddp["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-7, nan_ok=True), name
    if algorithm in ("scaffold", "ditto", "fedproto"):
        assert single["store"], "the check must compare some client state"
    if algorithm == "fedavg_fail_first":
        assert single["metrics"]["faults/failed"] == 1.0


def test_assign_clients_balances_local_steps_deterministically():
    steps = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4]
    ranks = assign_clients(steps, 2)
    assert sorted(p for r in ranks for p in r) == list(range(len(steps)))
    loads = [sum(steps[p] for p in r) for r in ranks]
    assert loads == [12, 12]  # round-robin would give 19 / 5
    assert ranks == assign_clients(steps, 2)
    assert assign_clients([3] * 5, 2) == [[0, 2, 4], [1, 3]]  # equal steps: round-robin


LINEAR = ["FedAvg", "FedProx", "FedSAM", "FedAvgM", "FedAdam", "FedYogi", "LocalAdam", "FedAvgSVRG", "FedAvgP", "FedSim",
          "FedAlt", "SCAFFOLD", "FedDyn", "FedCM", "FedMIM", "FedLADA"]  # fmt: skip
GATHERED = ["FAdamET", "FAdamGT", "ScaffoldP"]  # their aggregate reads single uploads (y_delta of a subset) or is not rewritten


@pytest.mark.parametrize("name", LINEAR + GATHERED)
def test_linear_aggregate_is_declared_by_the_class_that_wrote_the_server_rule(name):
    algorithm = getattr(A, name)()
    assert declares_capability(algorithm, "linear_aggregate") == (name in LINEAR)


def test_a_subclass_that_rewrites_aggregate_gathers_until_it_declares():
    class Median(A.FedAvg):  # a non-linear aggregate
        def aggregate(self, x, uploads, weights, server_state, info, local_steps):
            deltas = [u["delta"] for u in uploads]
            return {k: -torch.stack([d[k] for d in deltas]).median(0).values for k in x}, server_state

    class OnlySum(A.SCAFFOLD):  # rewrites how uploads are summed, not what the aggregate is
        def upload_sum(self, x, uploads, weights, info):
            return super().upload_sum(x, uploads, weights, info)

    class Declared(OnlySum):
        linear_aggregate = True

    assert not declares_capability(Median(), "linear_aggregate")
    assert not declares_capability(OnlySum(), "linear_aggregate")
    assert declares_capability(Declared(), "linear_aggregate")


@pytest.mark.parametrize("name", ["FedAvg", "SCAFFOLD", "FedDyn", "FedCM", "FedMIM", "FedLADA"])
def test_aggregate_from_partial_sums_equals_aggregate(name):
    """What DDP relies on: sums over disjoint client sets (one of them empty) add up to the aggregate's."""
    algorithm, gen = getattr(A, name)(), torch.Generator().manual_seed(0)
    x = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    uploads = [{n: {k: torch.randn(v.shape, generator=gen) for k, v in x.items()} for n in ("delta", "delta_c")} for _ in range(5)]
    weights, steps = torch.rand(5, generator=gen, dtype=torch.float64), [3, 4, 5, 4, 2]
    info = A.RoundInfo(round=2, local_lr=0.1, num_clients=10)
    server_state = algorithm.server_state_init(x)
    full = algorithm.aggregate(x, uploads, weights, server_state, info, steps)
    parts = [algorithm.upload_sum(x, uploads[a:b], weights[a:b], info) for a, b in ((0, 2), (2, 2), (2, 5))]
    sums = {n: {k: sum(p[n][k] for p in parts) for k in td} for n, td in parts[0].items()}
    from_sums = algorithm.aggregate_sum(x, sums, server_state, info, steps)
    for whole, summed in zip(full, from_sums):
        torch.testing.assert_close(summed, whole, rtol=1e-6, atol=1e-6)


def test_round_metrics_from_sums_equal_round_metrics_from_uploads():
    """train/consistency from the float64 sums (local_consistency centres small tensors in float32,
    hence rel=1e-6); comm/* from the uploads' sizes: the same row."""
    gen = torch.Generator().manual_seed(1)
    uploads = [{"delta": {"w": torch.randn(6, 4, generator=gen), "b": torch.randn(4, generator=gen)}} for _ in range(7)]
    broadcast = {"x": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}}
    delta_sum = {k: sum(u["delta"][k].double() for u in uploads) for k in ("w", "b")}
    delta_sq = sum(float(v.double().square().sum()) for u in uploads for v in u["delta"].values())
    losses, accuracies = [0.5 + i for i in range(7)], [0.1 * i for i in range(7)]
    from_uploads = round_metrics(3, 0.1, losses, uploads, broadcast, {"bytes_up": 0, "bytes_down": 0, "client_uploads": 0}, accuracies)
    from_sums = round_metrics(
        3, 0.1, losses, [], broadcast, {"bytes_up": 0, "bytes_down": 0, "client_uploads": 0}, accuracies,
        upload_bytes=[payload_bytes(u) for u in uploads], consistency=consistency_from_sums(delta_sum, delta_sq, 7),
    )  # fmt: skip
    assert from_sums.keys() == from_uploads.keys()
    for name, value in from_uploads.items():
        assert from_sums[name] == (pytest.approx(value, rel=1e-6) if name == "train/consistency" else value), name
    assert consistency_from_sums({}, 0.0, 0) == 0.0


def test_a_fatal_error_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """A setup error raised on rank 1 only: rank 0 (the process the user started) blocked in the round's
    exchange until gloo noticed the dead peer, then ended with 'Connection closed by peer' instead of the error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_fault.py"), "--fail-rank", "1"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    rank0 = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))
    assert "RankFailed: round 1: rank 1 failed: FatalClientError: round 1: client" in rank0, proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr


def test_a_stop_signal_seen_by_one_rank_stops_every_rank_as_a_stop(tmp_path):
    """A rank that stopped on SIGTERM during its clients' steps: the others stop as interrupted too (exit 143
    from the CLI), not as failed, and not waiting in the next round's exchange."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "ddp_fault.py"), "--fail-rank", "1", "--interrupt"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode != 0
    rank0 = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))
    assert "RunInterrupted: round 1: stopped by SIGTERM on rank 1 (the round is not aggregated); no stop checkpoint under DDP" in rank0, proc.stderr[-3000:]


# ---- DDP from the command line (fl_lightning/run/launch.py) -------------------------------------------
FL_LIGHTNING = str(Path(sys.executable).with_name("fl-lightning"))
TINY_FIT = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", "2"]  # fmt: skip
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]


def _cli(cwd: Path, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([FL_LIGHTNING, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(cwd: Path, timeout: float = 240) -> list[tuple[int, str]]:
    """Two `fl-lightning fit --trainer.num_nodes 2` processes, node ranks 0 and 1, rendezvous on 127.0.0.1 (the
    environment a cluster scheduler sets, docs/cluster.md): (exit code, stderr) of each."""
    port, env = _free_port(), {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1"}
    nodes = [subprocess.Popen([FL_LIGHTNING, *TINY_FIT, "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
                               "--trainer.num_nodes", "2", "--trainer.devices", "1"],
                              env={**env, "MASTER_PORT": str(port), "NODE_RANK": str(rank)}, cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]  # fmt: skip
    try:
        return [(node.wait(timeout=timeout), node.communicate()[1]) for node in nodes]
    finally:
        for node in nodes:
            node.kill()


def test_ddp_from_the_cli_and_two_nodes_equal_one_process(tmp_path):
    """The README's DDP line, shortened to 2 rounds: rank 1 is relaunched as `fl-lightning fit <the same arguments>`
    (it got no subcommand and rank 0 waited forever). Its global model, and that of two single-process nodes
    (num_nodes 2, NODE_RANK 0 and 1), is the one-process model to float tolerance (FedAvg sums its uploads per
    rank, then all-reduces)."""
    for name in ("one", "two", "nodes"):
        (tmp_path / name).mkdir()
    single = _cli(tmp_path / "one", *TINY_FIT)
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = _cli(tmp_path / "two", *TINY_FIT, *DDP, timeout=240)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in ddp.stdout + ddp.stderr
    assert "FedAvg: 2 rounds" in ddp.stdout and "usage: fl-lightning" not in ddp.stdout
    nodes = _two_nodes(tmp_path / "nodes")
    assert [code for code, _ in nodes] == [0, 0], nodes[0][1][-2000:] + nodes[1][1][-2000:]
    ckpt = "runs/quickstart/version_0/checkpoints/last.ckpt"
    one = torch.load(tmp_path / "one" / ckpt, weights_only=True)
    for other in ("two", "nodes"):
        other = torch.load(tmp_path / other / ckpt, weights_only=True)
        assert one["global_step"] == other["global_step"] == 2
        assert one["state_dict"].keys() == other["state_dict"].keys()
        for name, value in one["state_dict"].items():
            torch.testing.assert_close(other["state_dict"][name], value, rtol=1e-5, atol=1e-6)
    # The round and evaluation metrics too: each rank evaluates its own share of the test set, no sample twice
    # (Lightning's DistributedSampler padded 359 samples to 360 with a repeat: val/acc 31/360, not 31/359).
    logged = {name: _metrics(tmp_path / name / "runs/quickstart/version_0/metrics.csv") for name in ("one", "two", "nodes")}
    assert logged["one"]["val/acc"] and logged["one"]["train/loss"]
    for other in ("two", "nodes"):
        assert logged[other].keys() == logged["one"].keys()
        for column, values in logged["one"].items():
            assert logged[other][column] == pytest.approx(values, rel=1e-5, abs=1e-6), (other, column)


def _metrics(path: Path) -> dict[str, list[float]]:
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = ("train/loss", "train/acc", "train/consistency", "val/acc", "val/loss", "comm/cumulative_bytes")
    return {c: [float(r[c]) for r in rows if r.get(c)] for c in columns}


def test_a_rank_that_dies_before_the_rendezvous_stops_every_rank_in_one_line(tmp_path):
    """Rank 1 exits (code 3) at interpreter start-up, before it joins: rank 0 waited in the rendezvous for the
    process-group timeout (30 min); now it ends within seconds naming the rank and the cause, exit 2."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import os\nif os.environ.get("LOCAL_RANK") == "1":\n    os._exit(3)\n')
    proc = _cli(tmp_path, *TINY_FIT, *DDP, "--trainer.logger", "false", timeout=120,
                env={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fl-lightning: error:")]
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"fl-lightning: error: rank 1 \(pid \d+\) exited with code 3 before the process group formed; "
                        r"every rank stops \(its own error, if any, is above\)", lines[0]), lines[0]  # fmt: skip
    assert "Traceback" not in proc.stderr


def test_the_rendezvous_timeout_setting_is_checked_and_an_address_in_use_is_named(monkeypatch):
    from fl_lightning.run.launch import TIMEOUT_ENV, RankWatch, RelaunchCommand, exit_cause, rendezvous_timeout

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert rendezvous_timeout() == 300.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert rendezvous_timeout() == 7.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}='{bad}': seconds the ranks wait to form the process group, a number > 0"):
            rendezvous_timeout()
    assert exit_cause(-9) == "was killed by SIGKILL" and exit_cause(3) == "exited with code 3"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1"), monkeypatch.setenv("MASTER_PORT", "29500")
    raised = RuntimeError("The server socket has failed to listen on any local network address. port: 29500, code: -98, name: EADDRINUSE")
    error = RelaunchCommand.explained(raised, 0, RankWatch(0, 2, [], 1.0))
    assert isinstance(error, ValueError) and str(error).startswith("rank 0: MASTER_PORT 29500 is in use on 127.0.0.1 (EADDRINUSE)")
    lost = RelaunchCommand.explained(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), 1, RankWatch(1, 2, [], 1.0))
    assert str(lost).startswith("rank 1 lost its connection to another rank (RuntimeError: [gloo] Connection closed by peer")


def test_compare_and_montecarlo_refuse_a_multi_process_fit_in_one_line(tmp_path, monkeypatch):
    """They run fits one after another inside their own process (build without a subcommand); a DDP fit there
    would relaunch ranks that outlive it and reuse its process group. Refused, for the whole sweep."""
    from fl_lightning.commands.cli import build_cli
    from fl_lightning.run.cli_app import SeveralProcesses
    from fl_lightning.experiments.compare import compare

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SeveralProcesses, match=r"--trainer.devices x --trainer.num_nodes = 2 processes: compare and montecarlo"):
        build_cli(["--config", str(ROOT / "configs" / "quickstart.yaml"), *DDP], run=False, exit_on_error=False)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {ROOT / 'configs' / 'quickstart.yaml'}\nseeds: [0]\noverrides:\n  trainer.strategy: ddp\n"
                     "  trainer.devices: 2\n  trainer.accelerator: cpu\nruns:\n  FedAvg: {}\n")  # fmt: skip
    with pytest.raises(SeveralProcesses):
        compare(sweep, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fedbuff_events_split_over_two_processes_equal_one_process(tmp_path):
    """FedBuff under the clock (docs/algorithms.md, 27): each version's buffered clients split over the ranks."""
    single, ddp = _train(tmp_path, 1, "fedavg", False, "--fedbuff", "6", "4"), _train(tmp_path, 2, "fedavg", False, "--fedbuff", "6", "4")
    _assert_close(single, ddp, rtol=0, atol=0)
    assert single["metrics"]["time/sim_s"] == ddp["metrics"]["time/sim_s"] > 0
    assert ddp["exchanges"]["gathered"] >= 3  # one exchange per version of each update
