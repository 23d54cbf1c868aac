"""Every client's sample indices in two tensors, not one tensor per client.

``ClientIndices`` holds the indices of all clients back to back (``flat``) and where each
client's run starts (``offsets``, N + 1 entries): client i's indices are
``flat[offsets[i]:offsets[i + 1]]``, a view made when it is asked for. Building a population
of 10^6 clients is then a few vectorised operations on ``n + N`` integers instead of 10^6
tensors (docs/cluster.md, "Very large populations").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor


class ClientIndices(Sequence):
    """An immutable sequence of per-client index tensors over one flat tensor."""

    def __init__(self, flat: Tensor, offsets: Tensor) -> None:
        self.flat, self.offsets = flat.to(torch.int64), offsets.to(torch.int64)

    @classmethod
    def from_parts(cls, parts: Sequence[Tensor]) -> ClientIndices:
        """Per-client index tensors, each sorted (a client's training indices are kept in order)."""
        sizes = np.array([len(p) for p in parts], dtype=np.int64)
        flat = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]) if len(parts) else np.empty(0, np.int64)
        return cls.from_segments(flat, sizes)

    @classmethod
    def from_segments(cls, values: np.ndarray, sizes: np.ndarray) -> ClientIndices:
        """Consecutive runs of ``values`` of the given ``sizes``, each run sorted (as ``np.sort`` of each part)."""
        sizes = np.asarray(sizes, dtype=np.int64)
        owner = np.repeat(np.arange(len(sizes)), sizes)
        flat = np.asarray(values, dtype=np.int64)[np.lexsort((values, owner))]
        return cls(torch.from_numpy(flat), torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)])))

    def sizes(self) -> Tensor:
        return self.offsets.diff()

    def sizes_of(self, clients: Tensor) -> Tensor:
        """``len(self[c])`` of every client in ``clients`` (int64, each in ``range(len(self))``), in two gathers."""
        return self.offsets[clients + 1] - self.offsets[clients]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, client: int) -> Tensor:  # type: ignore[override]
        if isinstance(client, slice):
            return [self[i] for i in range(*client.indices(len(self)))]  # type: ignore[return-value]
        client = _client_position(client, len(self))
        start, end = self.offsets[client : client + 2].tolist()
        return self.flat[start:end]

    def __iter__(self) -> Iterator[Tensor]:
        bounds = self.offsets.tolist()
        return (self.flat[a:b] for a, b in zip(bounds, bounds[1:]))

    def digest_bytes(self) -> bytes:
        """Every client's ``len`` (8 bytes, little-endian) followed by its indices (int64): the bytes
        ``fingerprint.partition_digest`` hashes client by client, in one buffer."""
        sizes = self.sizes()
        out = torch.empty(len(self.flat) + len(self), dtype=torch.int64)
        starts = self.offsets[:-1] + torch.arange(len(self))  # each client's size slot
        out[starts] = sizes
        is_index = torch.ones(len(out), dtype=torch.bool)
        is_index[starts] = False
        out[is_index] = self.flat
        return out.numpy().astype("<i8", copy=False).tobytes()


class NoIndices(Sequence):
    """``num_clients`` empty index tensors (no holdout split)."""

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self._empty = torch.empty(0, dtype=torch.int64)

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, client: int) -> Tensor:  # type: ignore[override]
        if isinstance(client, slice):
            return [self._empty] * len(range(*client.indices(len(self))))  # type: ignore[return-value]
        if not -self.num_clients <= int(client) < self.num_clients:
            raise IndexError(f"client {client} out of range for {self.num_clients} clients")
        return self._empty


class HeldOutSplit:
    """Each client's samples split into held-out, validation and training parts, a client's split made
    when it is asked for (``FederatedDataModule.setup``: a permutation of the client's indices seeded by
    ``derive_seed(seed, client, stream)``; the first ``floor(holdout * n)`` are held out, the next
    ``floor(validation * n)`` validate, the rest train, each part sorted)."""

    def __init__(self, parts: ClientIndices, seed: int, stream: int, holdout: float, validation: float) -> None:
        self.parts, self.seed, self.stream = parts, seed, stream
        sizes = parts.sizes().double()
        # float64 products floored: the same counts as math.floor(fraction * n) in Python
        self.n_hold = (holdout * sizes).floor().to(torch.int64)
        self.n_val = (validation * sizes).floor().to(torch.int64)
        self.train_sizes = parts.sizes() - self.n_hold - self.n_val
        self.train, self.holdout = _Part(self, "train"), _Part(self, "holdout")

    def split(self, client: int) -> tuple[Tensor, Tensor, Tensor]:
        """(train, holdout, validation) indices of ``client``; train and holdout sorted."""
        from fl_lightning.core.participation import derive_seed

        idx = self.parts[client]
        generator = torch.Generator().manual_seed(derive_seed(self.seed, client, self.stream))
        perm = idx[torch.randperm(len(idx), generator=generator)]
        n_hold, n_val = int(self.n_hold[client]), int(self.n_val[client])
        return perm[n_hold + n_val :].sort().values, perm[:n_hold].sort().values, perm[n_hold : n_hold + n_val]

    def holdout_parts(self, client: int) -> tuple[Tensor, Tensor]:
        """The client's held-out samples as (validation, test), each sorted: the first ``floor(n_hold / 2)`` of its
        permutation select (``val/personal_*``), the rest report (``test/personal_*``): selection never sees the
        numbers it is reported by. The last clients asked for are kept (an evaluation reads each twice)."""
        from fl_lightning.core.participation import derive_seed

        cache = self.__dict__.setdefault("_holdout_parts", {})
        if client not in cache:
            if len(cache) >= _Part.CACHED:
                cache.pop(next(iter(cache)))
            idx = self.parts[client]
            generator = torch.Generator().manual_seed(derive_seed(self.seed, client, self.stream))
            held = idx[torch.randperm(len(idx), generator=generator)][: int(self.n_hold[client])]
            half = len(held) // 2
            cache[client] = (held[:half].sort().values, held[half:].sort().values)
        return cache[client]


class _Part(Sequence):
    """One part (train or holdout) of every client of a ``HeldOutSplit``; the last clients asked for are kept."""

    CACHED = 4096

    def __init__(self, split: HeldOutSplit, part: str) -> None:
        self.split, self.position = split, ("train", "holdout").index(part)
        self._cache: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self.split.parts)

    def sizes_of(self, clients: Tensor) -> Tensor:
        """``len(self[c])`` of every client in ``clients`` (int64, each in ``range(len(self))``), without splitting them."""
        return (self.split.train_sizes, self.split.n_hold)[self.position][clients]

    def __getitem__(self, client: int) -> Tensor:  # type: ignore[override]
        if isinstance(client, slice):
            return [self[i] for i in range(*client.indices(len(self)))]  # type: ignore[return-value]
        client = _client_position(client, len(self))
        if client not in self._cache:
            if len(self._cache) >= self.CACHED:
                self._cache.pop(next(iter(self._cache)))
            self._cache[client] = self.split.split(client)[self.position]
        return self._cache[client]


def _client_position(client: int, count: int) -> int:
    """``client`` as a position in ``range(count)`` (negative counts from the end), or IndexError."""
    client = int(client)
    if client < 0:
        client += count
    if not 0 <= client < count:
        raise IndexError(f"client {client} out of range for {count} clients")
    return client
