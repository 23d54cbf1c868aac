"""Secure aggregation (fl_lightning/secagg, docs/algorithms.md section 31): Shamir sharing, the masked modular sum
decoded exactly (integers, bitwise) under dropouts after masking, the recovery that needs t shares, and a run whose
aggregate is the plain run's within the quantisation bound, sequential and batched; refusals in one line."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from datamodules import IID
from fl_lightning import algorithms
from fl_lightning.core.config import LocalTraining
from fl_lightning.core.participation import UniformSampling
from fl_lightning.engine.module import FederatedModule
from fl_lightning.pipeline.privacy import ClientPrivacy
from fl_lightning.robust import Robust
from fl_lightning.secagg import SecureAggregation, TooFewShares, protocol
from fl_lightning.secagg.encoding import clip_rows, plain_scale
from fl_lightning.secagg.graph import neighbour_graph
from fl_lightning.secagg.shamir import PRIME, reconstruct, share
from models import MLP
from tests.conftest import tiny_datamodule, tiny_trainer


# ---- Shamir sharing -------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [1, 3, 5])
def test_any_t_shares_reconstruct_the_secret_and_fewer_refuse(threshold):
    rng = random.Random(threshold)
    secret = rng.randrange(PRIME)
    shares = share(secret, list(range(7)), threshold, rng)
    assert len(set(shares.values())) == 7 or threshold == 1
    for trial in range(5):
        chosen = rng.sample(sorted(shares), threshold)
        assert reconstruct({h: shares[h] for h in chosen}, threshold) == secret
    if threshold > 1:
        with pytest.raises(TooFewShares, match=rf"only {threshold - 1} shares survive, fewer than the threshold t={threshold}") as error:
            reconstruct({h: shares[h] for h in list(shares)[: threshold - 1]}, threshold)
        assert "\n" not in str(error.value)


def test_the_shares_are_a_degree_t_minus_1_polynomial_over_the_field():
    """An independent Lagrange interpolation (Python integers, Fermat inverses) of t shares at 0."""
    secret, t = 123456789, 4
    shares = share(secret, [0, 2, 5, 9], t, random.Random(4))
    points = [(h + 1, y) for h, y in shares.items()]
    value = 0
    for xi, yi in points:
        term = yi
        for xj, _ in points:
            if xj != xi:
                term = term * xj * pow(xj - xi, PRIME - 2, PRIME) % PRIME
        value = (value + term) % PRIME
    assert value == secret


# ---- the masked sum ------------------------------------------------------------------------------
def _masked_round(n, k, dropped, bits=16, size=300, seed=0):
    """Clients' residues y_i, their masked vectors, and the server's unmasked sum over the arrivals."""
    modulus = 1 << bits
    generator = torch.Generator().manual_seed(seed)
    ys = torch.randint(0, modulus, (n, size), generator=generator)
    graph = neighbour_graph(n, k, torch.Generator().manual_seed(seed + 1))
    thresholds = [max(1, -(-len(g) // 2)) for g in graph]
    parties = protocol.setup([1000 + seed * 100 + i for i in range(n)], graph, thresholds)
    masked = {i: protocol.masked_input(i, ys[i], parties, graph, modulus) for i in range(n)}
    arrived = {i: z for i, z in masked.items() if i not in dropped}
    return ys, masked, protocol.unmask(arrived, parties, graph, thresholds, modulus), modulus


@pytest.mark.parametrize("k", [None, 4])
@pytest.mark.parametrize("dropped", [set(), {3}, {1, 4, 8}], ids=["0%", "10%", "30%"])
def test_the_masked_sum_is_the_plain_sum_of_the_arrivals_bitwise(k, dropped):
    ys, masked, total, modulus = _masked_round(10, k, dropped)
    survivors = [i for i in range(10) if i not in dropped]
    reference = ys[survivors].numpy().astype(np.int64).sum(0) % modulus  # numpy, independent of the protocol
    assert np.array_equal(total.numpy(), reference)
    for i in range(10):  # what the server receives is not the client's vector
        assert (masked[i] != ys[i]).float().mean() > 0.99


def test_recovery_uses_the_shares():
    """A corrupted share of a dropped client's key gives a wrong sum: the masks are removed from the shares."""
    n, modulus, size = 6, 1 << 16, 50
    ys = torch.randint(0, modulus, (n, size), generator=torch.Generator().manual_seed(0))
    graph = neighbour_graph(n, None, torch.Generator().manual_seed(1))
    thresholds = [3] * n
    parties = protocol.setup(list(range(n)), graph, thresholds)
    arrived = {i: protocol.masked_input(i, ys[i], parties, graph, modulus) for i in range(1, n)}
    good = protocol.unmask(arrived, parties, graph, thresholds, modulus)
    assert torch.equal(good, ys[1:].sum(0) % modulus)
    parties[0].key_shares[1] = (parties[0].key_shares[1] + 1) % PRIME
    assert not torch.equal(protocol.unmask(arrived, parties, graph, thresholds, modulus), good)


def test_fewer_than_t_surviving_neighbours_abort_in_one_line():
    n, modulus = 8, 1 << 12
    graph = neighbour_graph(n, 4, torch.Generator().manual_seed(0))
    thresholds = [3] + [1] * (n - 1)  # only client 0's secrets need three shares
    parties = protocol.setup(list(range(n)), graph, thresholds)
    ys = torch.zeros(n, 10, dtype=torch.int64)
    dropped = set(sorted(graph[0])[:2]) | {0}  # client 0 and two of its four neighbours: 2 < t = 3 shares of its key
    arrived = {i: protocol.masked_input(i, ys[i], parties, graph, modulus) for i in range(n) if i not in dropped}
    with pytest.raises(TooFewShares, match=r"dropped client 0's key: only 2 shares survive, fewer than the threshold t=3") as error:
        protocol.unmask(arrived, parties, graph, thresholds, modulus)
    assert "\n" not in str(error.value)


def test_secagg_plus_graph_is_k_regular_and_classic_is_complete():
    graph = neighbour_graph(20, 6, torch.Generator().manual_seed(0))
    assert all(len(g) == 6 and i not in g for i, g in enumerate(graph))
    assert all(i in graph[j] for i, g in enumerate(graph) for j in g)  # symmetric
    assert all(len(g) == 19 for g in neighbour_graph(20, None, torch.Generator()))


@pytest.mark.parametrize("late", [0.0, 0.1, 0.3])
def test_a_round_decodes_the_fixed_point_sum_of_the_arrivals_exactly(late):
    """The round as the stage runs it: the decoded sum is the integer sum of the arrivals' encodings over s, bitwise,
    and within n / s of their clipped float sum."""
    n, size = 20, 64
    vectors = torch.randn(n, size, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    secagg = SecureAggregation(bits=18, clip=2.0, neighbours=6, dropout_after_masking=late)
    seeds = [7000 + i for i in range(n)]
    out = secagg.run(vectors, list(range(n)), seeds, server_seed=11)
    assert (n - len(out.arrived) > 0) == (late > 0)
    ints, facts = secagg.encode(vectors, seeds, n, None)  # each client's integers, from its own seed
    plain = ints[out.arrived].numpy().sum(0)
    assert torch.equal(out.total, torch.from_numpy(plain).double() / facts["scale"])
    clipped = clip_rows(vectors, 2.0)[out.arrived].sum(0)
    assert float((out.total - clipped).abs().max()) <= len(out.arrived) / plain_scale(18, n, 2.0)
    assert out.metrics["secagg/overflow"] == 0 and out.metrics["secagg/dropped"] == n - len(out.arrived)


def test_overflow_is_counted_not_silent():
    """At a bit width too small for the noise's k standard deviations the sum wraps: counted in the metrics."""
    vectors = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    secagg = SecureAggregation(bits=8, clip=1.0, noise="gaussian", noise_multiplier=1.0, k_stddevs=0.5)
    out = secagg.run(vectors, list(range(8)), list(range(8)), 0)
    assert out.metrics["secagg/overflow"] > 0


# ---- a run -----------------------------------------------------------------------------------------
def _fit(tmp_path, secagg, execution="sequential", algorithm=None, rounds=1):
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=3, hidden=[4]).double()
    module = FederatedModule(model, algorithm, LocalTraining(lr=0.3, steps=3, batch_size=None), execution=execution, secure_aggregation=secagg)
    data = tiny_datamodule(num_clients=4, partition=IID(), dtype="float64")
    data.participation = UniformSampling(4)  # equal weights: the secure sum weighs every client alike
    tiny_trainer(tmp_path, rounds, precision="64-true").fit(module, datamodule=data)
    return module


@pytest.mark.parametrize("execution", ["sequential", "batched"])
@pytest.mark.parametrize("algorithm", [algorithms.FedAvg, algorithms.SCAFFOLD])
def test_where_nothing_wraps_the_secure_aggregate_is_the_plain_one_within_the_quantisation_bound(tmp_path, execution, algorithm):
    clip, bits = 100.0, 24  # no upload is clipped; the mean of the decoded values is within 1 / s of the mean
    plain = _fit(tmp_path / "plain", None, execution, algorithm())
    secure = _fit(tmp_path / "secure", SecureAggregation(bits=bits, clip=clip, neighbours=2), execution, algorithm())
    if execution == "batched":
        assert not secure.executor.fallbacks  # stacked, not run client by client
    bound = 1.0 / plain_scale(bits, 4, clip)
    differences = [float((a - b).detach().abs().max()) for a, b in zip(plain.model.parameters(), secure.model.parameters())]
    assert 0 < max(differences) <= bound
    if algorithm is algorithms.SCAFFOLD:  # the control variates' upload passes through the secure sum too
        for name, c in plain.server_state["c"].items():
            assert 0 < float((c - secure.server_state["c"][name]).abs().max()) <= bound


def test_a_round_with_too_few_shares_is_aborted_and_aggregates_nothing(tmp_path):
    """Threshold 1: a client's secrets need all its neighbours' shares, so any dropout after masking aborts the round."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module = FederatedModule(MLP(in_features=8, num_classes=3, hidden=[4]), local=LocalTraining(lr=0.3, steps=2, batch_size=8),
                             secure_aggregation=SecureAggregation(bits=16, clip=1.0, threshold=1.0, dropout_after_masking=0.5))  # fmt: skip
    before = [p.detach().clone() for p in module.model.parameters()]
    tiny_trainer(tmp_path, 2, logger=CSVLogger(tmp_path, name="m")).fit(module, datamodule=tiny_datamodule(4, 4))
    (path,) = tmp_path.rglob("metrics.csv")
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/clients")]
    aborted = [float(r["secagg/aborted"] or 0) == 1 for r in rows]
    assert aborted == [False, True]  # round 0: every client delivered; round 1: a dropout after masking
    assert float(rows[0]["train/clients"]) == 4 and float(rows[1]["train/clients"]) == 0 and not rows[1]["secagg/clients"]
    assert not all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


# ---- refusals --------------------------------------------------------------------------------------
def _module(**settings):
    return FederatedModule(MLP(in_features=8, num_classes=3, hidden=[4]), local=LocalTraining(steps=2, batch_size=8), **settings)


@pytest.mark.parametrize("settings, line", [
    ({"robust": Robust("median")}, "model.robust with model.secure_aggregation: it reads each client's upload"),
    ({"privacy": ClientPrivacy(clip_norm=1.0)}, "model.secure_aggregation with model.privacy: client-level DP's noise"),
])  # fmt: skip
def test_what_reads_single_uploads_is_refused_in_one_line(settings, line):
    with pytest.raises(ValueError, match=re.escape(line)) as error:
        _module(secure_aggregation=SecureAggregation(), **settings)
    assert "\n" not in str(error.value)


def test_an_algorithm_that_is_not_a_sum_is_refused_in_one_line(tmp_path):
    module = _module(algorithm=algorithms.FedFV(), secure_aggregation=SecureAggregation())
    with pytest.raises(ValueError, match=r"model.secure_aggregation: FedFV cannot be securely aggregated: .*linear_aggregate") as error:
        tiny_trainer(tmp_path, 1).fit(module, datamodule=tiny_datamodule(4, 4))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kw, line", [
    ({"bits": 1}, "secure_aggregation.bits must be an integer in [2, 62], got 1"),
    ({"neighbours": 3}, "secure_aggregation.neighbours must be an even integer >= 2"),
    ({"threshold": 0.0}, "secure_aggregation.threshold must be in (0, 1]"),
    ({"dropout_after_masking": 1.0}, "secure_aggregation.dropout_after_masking must be in [0, 1)"),
    ({"noise": "laplace"}, "secure_aggregation.noise must be null, 'gaussian' or 'skellam'"),
])  # fmt: skip
def test_bad_settings_are_refused_in_one_line(kw, line):
    with pytest.raises(ValueError, match=re.escape(line)):
        SecureAggregation(**kw)


def test_too_few_bits_for_the_cohort_are_refused_before_training(tmp_path):
    module = _module(secure_aggregation=SecureAggregation(bits=3))
    with pytest.raises(ValueError, match=r"secure_aggregation.bits=3 cannot hold the sum of 4 clients"):
        tiny_trainer(tmp_path, 1).fit(module, datamodule=tiny_datamodule(4, 4))


@pytest.mark.parametrize("config", ["secagg_digits", "ddg_digits"])
def test_the_config_fits_through_the_cli_and_logs_the_protocols_cost(tmp_path, monkeypatch, config):
    import csv
    from pathlib import Path

    from fl_lightning.commands.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(Path(__file__).resolve().parents[1] / "configs" / f"{config}.yaml"), "--trainer.max_steps", "2",
          "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false"])  # fmt: skip
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("secagg/bytes_per_client")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["secagg/bytes_per_client"]) > float(row["secagg/vector_bytes"]) > 0  # keys and shares besides the vector
        assert float(row["secagg/overflow"]) >= 0 and float(row["secagg/server_seconds"]) > 0
    if config == "ddg_digits":
        epsilons = [float(r["privacy/epsilon"]) for r in rows]
        assert 0 < epsilons[0] < epsilons[1]
