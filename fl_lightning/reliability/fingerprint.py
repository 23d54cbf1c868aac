"""What a resumed run must share with the checkpoint it continues, and the differences, one phrase each.

A fingerprint holds the algorithm's class and state schema, the model's tensor names and shapes,
the number of clients and the partition's identity (a digest of every client's sample indices).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
from torch import nn

from fl_lightning.core.params import TensorDict


def schema(algorithm: Any, model: nn.Module, x: TensorDict) -> dict[str, Any]:
    """The algorithm's class and the names of its client and server state, and the model's shapes."""
    client_state, server_state = algorithm.client_state_init(x), algorithm.server_state_init({k: v.clone() for k, v in x.items()})
    cls = type(algorithm)
    return {
        "version": 1,
        "algorithm": f"{cls.__module__}.{cls.__qualname__}",
        "client_state": sorted(f"{n}/{k}" for n, td in client_state.items() for k in td),
        "server_state": sorted(f"{n}/{k}" for n, td in server_state.items() for k in td),
        "model": {n: list(t.shape) for n, t in model.state_dict().items() if isinstance(t, torch.Tensor)},
    }


def partition_digest(data: Any) -> str:
    """A digest of every client's training sample indices (their sizes where indices are not kept)."""
    digest = hashlib.sha256()
    parts = getattr(data, "client_train", None)
    if callable(getattr(parts, "digest_bytes", None)):  # every client's indices in one buffer (the same bytes)
        digest.update(parts.digest_bytes())
        return digest.hexdigest()
    for part in parts if parts is not None else [data.client_sizes]:
        part = torch.as_tensor(part).to(torch.int64).reshape(-1)
        digest.update(len(part).to_bytes(8, "little") + part.numpy().tobytes())
    return digest.hexdigest()


_SCALARS = (bool, int, float, str, type(None))


def describe_setting(obj: Any) -> str:
    """A setting object (an attack, a robust rule) as ``Class(name=value, ...)``: its class and the values of
    its constructor's arguments that are plain values or, one level down, other setting objects; what it
    derives at run time (the malicious clients, a built rule) is left out."""

    def value(v: Any, depth: int) -> str | None:
        if isinstance(v, _SCALARS):
            return repr(v)
        if isinstance(v, (list, tuple)) and all(isinstance(e, _SCALARS) for e in v):
            return repr(list(v))
        if isinstance(v, dict) and all(isinstance(e, _SCALARS) for e in (*v, *v.values())):
            return repr(dict(sorted(v.items())))
        if depth == 0 and hasattr(v, "__dict__") and not callable(v) and type(v).__module__.startswith("fl_lightning"):
            return describe(v, depth + 1)
        return None

    def describe(o: Any, depth: int) -> str:
        names = [n for n in inspect.signature(type(o)).parameters if hasattr(o, n)]  # its settings, not what it derives
        fields = ((k, value(getattr(o, k), depth)) for k in sorted(names))
        return f"{type(o).__name__}({', '.join(f'{k}={v}' for k, v in fields if v is not None)})"

    return describe(obj, 0)


def _states(fingerprint: dict[str, Any]) -> str:
    names = lambda key: sorted({k.split("/")[0] for k in fingerprint.get(key, [])})  # noqa: E731
    return f"(client state {names('client_state') or 'none'}, server state {names('server_state') or 'none'})"


def differences(saved: dict[str, Any] | None, now: dict[str, Any], saved_server_state: dict[str, Any], algorithm_name: str) -> list[str]:
    """What differs between a checkpoint's fingerprint and this run's (``saved`` None: a checkpoint
    written before fingerprints; only its server state's names can be checked)."""
    if saved is None:
        old, new = sorted({k.split("/")[0] for k in saved_server_state}), sorted({k.split("/")[0] for k in now["server_state"]})
        return [] if old == new else [f"algorithm state: server state {old} in the checkpoint, {new} for {algorithm_name}"]
    diffs = []
    if any(saved.get(k) != now.get(k) for k in ("algorithm", "client_state", "server_state")):
        diffs.append(f"algorithm: {saved.get('algorithm')} {_states(saved)} in the checkpoint, {now['algorithm']} {_states(now)} in this run")
    if "num_clients" in saved and "num_clients" in now and saved["num_clients"] != now["num_clients"]:
        diffs.append(f"num_clients: {saved['num_clients']} in the checkpoint, {now['num_clients']} in this run")
    elif saved.get("partition", now.get("partition")) != now.get("partition", saved.get("partition")):
        diffs.append("partition: the checkpoint's clients hold other samples (the data seed, partition, dataset or holdout changed)")
    for setting in ("lora_aggregation", "attack", "robust"):  # absent in runs without one
        if saved.get(setting) != now.get(setting):
            diffs.append(f"model.{setting}: {saved.get(setting)} in the checkpoint, {now.get(setting)} in this run")
    old_model, new_model = saved.get("model", {}), now["model"]
    for name in [*old_model, *(n for n in new_model if n not in old_model)]:
        if old_model.get(name) != new_model.get(name):
            diffs.append(f"model parameters: {name} {old_model.get(name, 'absent')} in the checkpoint, {new_model.get(name, 'absent')} in this run")
            break
    return diffs
