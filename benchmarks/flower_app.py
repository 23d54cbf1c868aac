"""The Flower side of ``benchmarks/flower_compare.py``: an ordinary Flower app of the MLP workload.

Written the way Flower's own ``quickstart-pytorch`` example is (Flower >= 1.21, the
Message API): a ``ClientApp`` whose ``@app.train()`` loads the received weights into a
fresh model, trains on its partition with a ``DataLoader`` and ``torch.optim.SGD`` and
replies with the weights and ``num-examples``; a ``ServerApp`` running the built-in
``FedAvg`` strategy (``flwr.serverapp.strategy.FedAvg``, weights averaged by
``num-examples``) for R rounds, sampling S of the N virtual SuperNodes per round.
Learning rate, local steps and batch size travel in the train ``ConfigRecord``.

The workload is the one of ``benchmarks/run.py``'s ``mlp`` rows: ``build("mlp", S)``
gives the same seeded ``MLP(32, 10, hidden=[64])`` and the same IID partition of the
synthetic data over 100 clients; partition ``i`` is fl-lightning's client ``i``.
A client's data is built once per Ray worker process and kept (``_partition``), as a
Flower app would load its dataset once.

This module is imported by name (``benchmarks.flower_app``) so that Ray's workers
import it instead of receiving pickled copies of its functions and cache.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.run import LR, WORKLOADS, build
from models import MLP

WORKLOAD = "mlp"


@functools.lru_cache(maxsize=None)
def _partition(partition_id: int) -> TensorDataset:
    """Client ``partition_id``'s training samples (the datamodule is built once per process)."""
    data = _datamodule()
    x, y = data.source.train.tensors
    idx = data.client_train[partition_id]
    return TensorDataset(x[idx], y[idx])


@functools.lru_cache(maxsize=1)
def _datamodule():
    return build(WORKLOAD, 10)[1]  # S does not change the data or the partition


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """``local-steps`` SGD steps on minibatches of this node's partition, from the received model.

    Besides the loss, the reply's metrics hold ``fit-seconds``: the time spent in this
    function (FedAvg averages it over the round's clients).
    """
    started = time.perf_counter()
    torch.set_num_threads(1)
    config = msg.content["config"]
    model = MLP(32, 10, hidden=[64])
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    dataset = _partition(int(context.node_config["partition-id"]))
    loader = DataLoader(dataset, batch_size=int(config["batch-size"]), shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    model.train()
    total = 0.0
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # more steps than one epoch: go round again
    for x, y in itertools.islice(batches, int(config["local-steps"])):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    metrics = MetricRecord({"train_loss": total / int(config["local-steps"]), "num-examples": len(dataset),
                            "fit-seconds": time.perf_counter() - started})  # fmt: skip
    return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


def server_app(rounds: int, clients_per_round: int, report: dict) -> ServerApp:
    """FedAvg over ``rounds`` rounds of ``clients_per_round`` sampled nodes, no federated evaluation.

    Fills ``report``: ``round_ends``, ``time.time()`` before round 1 and after each
    round's aggregation (``evaluate_fn`` is called then; it evaluates nothing), and
    ``fit_seconds``, the clients' mean ``fit-seconds`` of each round.
    """
    round_ends = report.setdefault("round_ends", [])
    app = ServerApp()
    num_clients = WORKLOADS[WORKLOAD]["num_clients"]

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        model, _ = build(WORKLOAD, clients_per_round)  # seeded: the same initial model as fl-lightning's
        strategy = FedAvg(
            fraction_train=clients_per_round / num_clients, fraction_evaluate=0.0,
            min_train_nodes=clients_per_round, min_available_nodes=num_clients,
        )  # fmt: skip
        spec = WORKLOADS[WORKLOAD]
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
            train_config=ConfigRecord({"lr": LR, "local-steps": spec["steps"], "batch-size": spec["batch"]}),
            evaluate_fn=lambda server_round, arrays: round_ends.append(time.time()),
        )  # fmt: skip
        report["fit_seconds"] = [result.train_metrics_clientapp[r]["fit-seconds"] for r in range(1, rounds + 1)]

    return app
