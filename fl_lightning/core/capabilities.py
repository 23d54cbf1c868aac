"""Capabilities declared by the class that has them, never inherited by accident.

An algorithm's ``elementwise`` or ``linear_aggregate``, a model's ``independent_rows``: a flag
counts only if the class that sets it is (a subclass of) every class that defines one of the
methods the flag speaks for. A subclass that rewrites one of those methods must declare the
flag again. An instance may set the flag itself.
"""

from __future__ import annotations

from collections.abc import Sequence


def declared(obj: object, capability: str, methods: Sequence[str]) -> bool:
    """Whether ``obj`` has ``capability``, set on the instance or by the class that wrote ``methods``."""
    if capability in vars(obj):
        return bool(vars(obj)[capability])
    mro = type(obj).__mro__
    declarer = next((c for c in mro if capability in vars(c)), None)
    if declarer is None or not vars(declarer)[capability]:
        return False
    definers = (next(c for c in mro if m in vars(c)) for m in methods if any(m in vars(c) for c in mro))
    return all(issubclass(declarer, definer) for definer in definers)
