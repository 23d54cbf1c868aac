"""How many intra-op threads torch uses for a run (``--threads auto|N``).

Client models in federated simulations are often tiny: for them torch's default (one thread per
core) spins threads that wait on each other, and on a machine shared with other jobs it costs
several times the wall time and an order of magnitude more CPU. Measured on a 2-core machine
loaded by other jobs, one SGD step of the quickstart's SmallCNN (38k parameters, batch 20) took
12 ms with 1 thread against 56 ms with 2 (2.7 against 19 ms of CPU). ``auto`` therefore gives
models below ``AUTO_SINGLE_THREAD_BELOW`` parameters one thread and leaves larger ones on torch's
default (all cores). The thread count can change results in the last bits (torch's reductions
split their work by thread), so a run is bitwise reproducible for a given thread count.
"""

from __future__ import annotations

from typing import Any

AUTO_SINGLE_THREAD_BELOW = 1_000_000
"""``--threads auto``: models with fewer parameters (trainable or frozen) train on one thread."""


def parse_threads(setting: Any) -> int | None:
    """``auto`` -> None (decided by the model's size), a positive integer -> itself; else one line."""
    if setting is None or (isinstance(setting, str) and setting.strip().lower() == "auto"):
        return None
    try:
        if isinstance(setting, bool) or float(setting) != int(float(setting)):
            raise ValueError
        count = int(float(setting))
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise ValueError(f"threads must be auto or an integer >= 1 (torch intra-op threads), got {setting!r}")
    return count


def choose_threads(setting: Any, model: Any, cores: int | None = None) -> int:
    """The thread count ``setting`` gives for ``model`` (an ``nn.Module``); ``cores`` is torch's default."""
    import torch

    count = parse_threads(setting)
    if count is not None:
        return count
    default = cores if cores is not None else torch.get_num_threads()
    parameters = sum(p.numel() for p in model.parameters()) if model is not None else 0
    return 1 if parameters < AUTO_SINGLE_THREAD_BELOW else default


def apply_threads(setting: Any, model: Any) -> int:
    """Set torch's intra-op threads for ``model`` (before training) and return the count."""
    import torch

    count = choose_threads(setting, model, _default_threads())
    torch.set_num_threads(count)
    return count


_DEFAULT: list[int] = []


def _default_threads() -> int:
    """torch's own default (all cores), remembered before the first change."""
    import torch

    if not _DEFAULT:
        _DEFAULT.append(torch.get_num_threads())
    return _DEFAULT[0]
