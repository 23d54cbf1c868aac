"""Multi-process execution: the round's clients are split across the ranks of a
Lightning DDP run (gloo on CPU, NCCL on GPU).

Every rank receives the same round plan. Rank r trains the clients at positions
r, r + W, r + 2W, ... of the plan with its local executor, then the ranks
exchange their client results with ``torch.distributed`` so that every rank
aggregates the same uploads in plan order: the global model, the server state
and the client store are identical on every rank and equal to a one-process run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from fl_lightning.algorithms.base import ClientResult, Payload, RoundInfo
from fl_lightning.participation import RoundPlan

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule


def _to_cpu(obj):
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj.cpu() if hasattr(obj, "cpu") else obj


class DistributedExecution:
    """Wraps a one-process executor; a no-op when torch.distributed is not initialised."""

    def __init__(self, local_execution) -> None:
        self.local_execution = local_execution

    def run_warmup(self, module: FederatedModule, broadcast: Payload, info: RoundInfo):
        """A pass over all N clients (e.g. Scaffold-P's initialisation): every rank runs it whole."""
        return self.local_execution.run_warmup(module, broadcast, info)

    def run(self, module: FederatedModule, plan: RoundPlan, broadcast: Payload, info: RoundInfo) -> list[ClientResult]:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.local_execution.run(module, plan, broadcast, info)
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = list(range(rank, len(plan.clients), world))
        max_steps = None if plan.max_steps is None else plan.max_steps[mine]
        sub_plan = RoundPlan(plan.round, plan.clients[mine], plan.weights[mine], plan.seeds[mine], max_steps)
        results = self.local_execution.run(module, sub_plan, broadcast, info) if mine else []
        gathered: list[list[ClientResult] | None] = [None] * world
        dist.all_gather_object(gathered, [(r.client_id, _to_cpu(r.upload), _to_cpu(r.client_state), r.num_steps, r.mean_loss, _to_cpu(r.personal)) for r in results])
        device = module.device
        by_position: dict[int, ClientResult] = {}
        for r, part in enumerate(gathered):
            for position, (cid, upload, state, steps, loss, personal) in zip(range(r, len(plan.clients), world), part):
                upload = {n: {k: v.to(device) for k, v in td.items()} for n, td in upload.items()}
                by_position[position] = ClientResult(cid, upload, state, steps, loss, personal)
        return [by_position[i] for i in range(len(plan.clients))]
