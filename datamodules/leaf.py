"""The LEAF format (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018) read into tensors.

A LEAF folder holds ``train/*.json`` and ``test/*.json``; each file has ``users`` (ids), ``num_samples``
(one count per user) and ``user_data`` (``{user: {"x": [...], "y": [...]}}``). ``read_leaf`` streams the
files one by one (each parsed, its rows written into the growing tensors, then freed): the samples are held
once, in one ``x`` and one ``y`` tensor, the training rows first, then the test rows, each user's rows
contiguous. Rows are written into a numpy buffer that grows in place (``ndarray.resize``: a large buffer is
remapped, not copied), so the peak is the data once plus one parsed file (docs/fairness.md, "Natural users").
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .client_indices import ClientIndices

SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's Shakespeare alphabet (its models' ``ALL_LETTERS``): letter i has code i; any other character has code 80."""


@dataclass(frozen=True)
class LeafTask:
    """How one LEAF dataset's ``x`` and ``y`` become rows: the row shape, the dtype, the class count and
    the encoder of a user's ``x`` and ``y`` lists into numpy arrays (shape ``[n, *row]`` and ``[n]``)."""

    row: tuple[int, ...]
    floating: bool
    num_classes: int
    encode: Callable[[list, list], tuple[np.ndarray, np.ndarray]]
    shape: tuple[int, ...]  # the shape of a row as the model reads it


def _femnist(x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)


_ALPHABET = np.array([ord(c) for c in SHAKESPEARE_LETTERS], dtype=np.int64)
_SORTED = np.argsort(_ALPHABET)


def shakespeare_codes(text: str) -> np.ndarray:
    """The code of every character of ``text`` in ``SHAKESPEARE_LETTERS`` (80 for any other character)."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    at = np.searchsorted(_ALPHABET[_SORTED], points).clip(max=len(_ALPHABET) - 1)
    return np.where(_ALPHABET[_SORTED][at] == points, _SORTED[at], len(_ALPHABET))


def _shakespeare(x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    if any(len(s) != 80 for s in x) or any(len(c) != 1 for c in y):
        raise ValueError("Shakespeare x must be strings of 80 characters and y single characters")
    return shakespeare_codes("".join(x)).reshape(len(x), 80), shakespeare_codes("".join(y))


TASKS = {
    "femnist": LeafTask((784,), True, 62, _femnist, (1, 28, 28)),
    "shakespeare": LeafTask((80,), False, len(SHAKESPEARE_LETTERS) + 1, _shakespeare, (80,)),
}


@dataclass
class LeafData:
    """A LEAF folder's samples: ``x`` and ``y`` hold the clients' training rows (``x[:num_train]``), then the test
    rows. Client i is user ``users[i]``; its training rows are ``train[i]``, its LEAF test rows ``holdout[i]``
    (rows of ``x``; empty for a user LEAF put in the training users only, as ``-t user`` does)."""

    x: Tensor
    y: Tensor
    num_train: int
    users: list[str]
    train: ClientIndices
    holdout: ClientIndices
    num_classes: int


class _Rows:
    """Rows appended to numpy buffers that grow in place (x ``[capacity, *row]``, y ``[capacity]``)."""

    def __init__(self, row: tuple[int, ...], dtype: np.dtype) -> None:
        self.x = np.empty((0, *row), dtype=dtype)
        self.y = np.empty(0, dtype=np.int64)
        self.count = 0

    def append(self, x: np.ndarray, y: np.ndarray) -> None:
        end = self.count + len(y)
        if end > len(self.y):
            capacity = max(end, len(self.y) * 5 // 4, 1024)
            self.x.resize((capacity, *self.x.shape[1:]), refcheck=False)
            self.y.resize(capacity, refcheck=False)
        self.x[self.count : end], self.y[self.count : end] = x, y
        self.count = end

    def tensors(self) -> tuple[Tensor, Tensor]:
        self.x.resize((self.count, *self.x.shape[1:]), refcheck=False)
        self.y.resize(self.count, refcheck=False)
        return torch.from_numpy(self.x), torch.from_numpy(self.y)


def leaf_files(root: str, split: str) -> list[str]:
    """The ``.json`` files of ``root/split`` in sorted order, or one line saying the folder holds none."""
    files = sorted(glob.glob(os.path.join(root, split, "*.json")))
    if not files:
        raise ValueError(f"data.root: {os.path.join(root, split)} holds no .json file (LEAF's preprocess.sh writes train/ and test/)")
    return files


def _user_rows(path: str, data: object) -> list[tuple[str, list, list]]:
    """``(user, x, y)`` of every user of one parsed file, checked against its ``num_samples``."""
    if not isinstance(data, dict) or not all(k in data for k in ("users", "num_samples", "user_data")):
        raise ValueError(f"{path}: not a LEAF file (it needs the keys users, num_samples and user_data)")
    users, counts, user_data = data["users"], data["num_samples"], data["user_data"]
    if len(users) != len(counts):
        raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples entries")
    rows = []
    for user, count in zip(users, counts):
        own = user_data.get(user)
        if not isinstance(own, dict) or "x" not in own or "y" not in own:
            raise ValueError(f"{path}: user {user!r} has no user_data entry with x and y")
        if len(own["x"]) != count or len(own["y"]) != count:
            raise ValueError(f"{path}: user {user!r} has num_samples {count} but {len(own['x'])} x and {len(own['y'])} y")
        rows.append((user, own["x"], own["y"]))
    return rows


def read_leaf(root: str, task: str = "femnist", max_users: int | None = None, dtype: torch.dtype = torch.float32) -> LeafData:
    """The LEAF folder ``root`` (``train/*.json``, ``test/*.json``) as tensors, streamed file by file.

    The clients are the users with training samples, in file order (files sorted by name): all of them, or the
    first ``max_users``. The test rows kept are those of the clients and of users with no training file entry
    (LEAF's held-out users); ``dtype`` is the floating dtype of ``x`` (FEMNIST). A malformed file is refused in
    one line naming it."""
    spec = TASKS[task]
    rows = _Rows(spec.row, torch.empty(0, dtype=dtype).numpy().dtype if spec.floating else np.int64)
    users: list[str] = []
    client_of: dict[str, int] = {}
    train_sizes: list[int] = []
    listed: set[str] = set()
    skipped: set[str] = set()  # training users past max_users: their test rows are not kept
    for path in leaf_files(root, "train"):
        for user, x, y in _user_rows(path, _load(path)):
            if user in listed:
                raise ValueError(f"{path}: user {user!r} appears a second time among the training files")
            listed.add(user)
            if max_users is not None and len(users) >= max_users:
                skipped.add(user)
            if not len(y) or user in skipped:
                continue
            rows.append(*_encoded(spec, path, user, x, y))
            client_of[user] = len(users)
            users.append(user)
            train_sizes.append(len(y))
    num_train = rows.count
    held: list[tuple[int, int, int]] = []  # (client, first row, rows) of each client's test rows
    seen: set[str] = set()
    for path in leaf_files(root, "test"):
        for user, x, y in _user_rows(path, _load(path)):
            if user in seen:
                raise ValueError(f"{path}: user {user!r} appears a second time among the test files")
            seen.add(user)
            if user in skipped or not len(y):
                continue
            if user in client_of:
                held.append((client_of[user], rows.count, len(y)))
            rows.append(*_encoded(spec, path, user, x, y))
    x, y = rows.tensors()
    train = ClientIndices(torch.arange(num_train), torch.tensor([0, *np.cumsum(train_sizes, dtype=np.int64)]))
    return LeafData(x.view(len(y), *spec.shape), y, num_train, users, train, _holdout(held, len(users)), spec.num_classes)


def _load(path: str) -> object:
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None


def _encoded(spec: LeafTask, path: str, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    try:
        xs, ys = spec.encode(x, y)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: user {user!r}: {e}") from None
    if xs.shape[1:] != spec.row:
        raise ValueError(f"{path}: user {user!r}: each x must have {spec.row[0]} values, got shape {list(xs.shape[1:])}")
    if len(ys) and not (0 <= ys.min() and ys.max() < spec.num_classes):
        raise ValueError(f"{path}: user {user!r}: labels must be in [0, {spec.num_classes}), got {ys.min()}..{ys.max()}")
    return xs, ys


def _holdout(held: list[tuple[int, int, int]], clients: int) -> ClientIndices:
    """Each client's test rows (one contiguous run each, or none) as ``ClientIndices``."""
    sizes = np.zeros(clients, dtype=np.int64)
    first = np.zeros(clients, dtype=np.int64)
    for client, start, count in held:
        sizes[client], first[client] = count, start
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    flat = np.repeat(first - offsets[:-1], sizes) + np.arange(offsets[-1])
    return ClientIndices(torch.from_numpy(flat), torch.from_numpy(offsets))
