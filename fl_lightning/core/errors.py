"""Known failures of a run.

Each is raised with one line that says what went wrong, where, and what to do; the
``fl-lightning`` command prints that line and exits with code 2 (``KNOWN_ERRORS``).
Set ``FL_LIGHTNING_TRACEBACK=1`` for the full traceback.
"""

from __future__ import annotations

import difflib
import errno
import os
import shutil
from pathlib import Path


class FLError(Exception):
    """A failure the user can act on: its message is one line plus a hint."""


class CheckpointError(FLError):
    """A checkpoint this run cannot use: it does not match the run, or what it references is gone or damaged."""


class StoreError(FLError):
    """A client store's folder is in use by another run, or one of its files is damaged."""


class RunInterrupted(FLError):
    """SIGTERM or SIGINT arrived: the run stops within one local step (an unfinished round is not
    aggregated) and ends with a checkpoint of the last completed round (``StopCheckpoint``)."""

    def __init__(self, round_idx: int, where: str, signal_name: str = "SIGTERM") -> None:
        self.round_idx, self.where, self.signal_name = round_idx, where, signal_name
        self.checkpoint: tuple[str, int] | None = None  # (path, completed rounds) once written
        self.unsaved = "no checkpoint was written (no ModelCheckpoint callback)"  # why, while checkpoint is None
        super().__init__(round_idx, where, signal_name)  # picklable

    @property
    def exit_code(self) -> int:
        return 130 if self.signal_name == "SIGINT" else 143  # 128 + the signal's number

    def __str__(self) -> str:
        if self.checkpoint is None:
            saved = f"{self.unsaved}; resume from the last checkpoint, if any"
        else:
            path, rounds = self.checkpoint
            saved = f"wrote the checkpoint of the {rounds} completed rounds: {path}; resume with --ckpt_path {path}"
        return f"round {self.round_idx}: stopped by {self.signal_name} {self.where}; {saved}"


class RankFailed(FLError):
    """Under DDP, another rank stopped with an error in this round: every rank stops with its message (no hang)."""


def interrupted(round_idx: int, client_id: int, step: int, steps: int) -> RunInterrupted:
    """The stop inside a round: the round is not aggregated."""
    return RunInterrupted(round_idx, f"during client {client_id}'s local step {step + 1} of {steps} (the round is not aggregated)")


KNOWN_ERRORS: tuple[type[BaseException], ...] = (ValueError, FLError)
"""What the command line reports in one line (exit code 2) instead of a traceback."""


def one_line(error: BaseException) -> str:
    """``TypeName: first line of the message`` (error messages of torch span many lines)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0].strip()}" if text else type(error).__name__


def did_you_mean(value: str, names: list[str], quiet: bool = False) -> str | None:
    """The name in ``names`` nearest to ``value`` (case-insensitive), or None if none is near.

    ``quiet=False`` answers ``"; did you mean X?"`` (or ``""``) to append to a message."""
    lowered = {n.lower(): n for n in names}
    if value.lower() in lowered:
        near = lowered[value.lower()]
    else:
        close = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.6)
        near = lowered[close[0]] if close else None
    if quiet:
        return near
    return f"; did you mean {near}?" if near else ""


# ---- failures of the machine, as one line ----------------------------------------------------------
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
WRITE_ERRNOS = (*NO_SPACE, errno.EFBIG, *NOT_WRITABLE)


def size_text(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


def _free(folder: Path) -> str:
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            try:
                return size_text(shutil.disk_usage(candidate).free)
            except OSError:
                return "unknown"
    return "unknown"


def write_failure(error: OSError, what: str, path: str | os.PathLike, needed: int | None = None, after: str = "") -> FLError:
    """One line for an OSError while writing ``what`` (e.g. "checkpoint") to ``path``: the cause
    (no space, file size limit, read-only or not permitted), the folder, the space it needed, and
    ``after`` (what is intact, what to do)."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    need = f", needs about {size_text(needed)}" if needed else ""
    if error.errno in NO_SPACE:
        cause = f"no space left on the device of {folder} ({_free(folder)} free{need})"
        todo = "free space there or write to another folder"
    elif error.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else size_text(limit)
        cause = f"file too large for {folder} (the process's file-size limit `ulimit -f` is {shown}, or the file system's{need})"
        todo = "raise the limit or write to another folder"
    elif error.errno in NOT_WRITABLE:
        cause = f"{folder} is not writable ({error.strerror or os.strerror(error.errno)})"
        todo = "make it writable or write to another folder"
    else:
        cause = f"{error.strerror or error} in {folder}"
        todo = "check the folder"
    return FLError(f"cannot write the {what} {path.name}: {cause}; {after + '; ' if after else ''}{todo}")


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())
    )


def memory_failure(error: BaseException, doing: str, hint: str) -> FLError:
    """One line for an allocation that failed while ``doing`` something."""
    import re

    asked = re.search(r"allocate (\d+) bytes", str(error)) or re.search(r"allocate ([\d.]+ [GMK]iB)", str(error))
    size = (size_text(int(asked[1])) if asked[1].isdigit() else asked[1]) if asked else "more than is free"
    return FLError(f"out of memory {doing}: tried to allocate {size} at once; {hint}")


def lightning_misconfiguration(error: BaseException) -> str | None:
    """One line for Lightning's MisconfigurationException (a Trainer setting it refused), else None."""
    if type(error).__name__ != "MisconfigurationException":
        return None
    text = " ".join(str(error).split())
    if "enable_checkpointing=False" in text and "ModelCheckpoint" in text:
        return ("--trainer.enable_checkpointing false, but trainer.callbacks holds a ModelCheckpoint (the config's); "
                "drop it too (--trainer.callbacks '[]') or leave checkpointing on")  # fmt: skip
    if "No supported gpu backend" in text or "GPUAccelerator" in text and "not available" in text:
        return "--trainer.accelerator gpu: this machine has no usable GPU; use --trainer.accelerator cpu (or auto)"
    return f"a trainer setting was refused by Lightning: {text}; see `fl-lightning fit --help-all` (the --trainer.* settings)"


def explain(error: BaseException) -> str | None:
    """One line for a known failure that is not an FLError (Lightning's settings, a full or read-only
    folder, memory), or None: the command line then shows the traceback."""
    line = lightning_misconfiguration(error)
    if line is not None:
        return line
    if isinstance(error, OSError) and error.errno in WRITE_ERRNOS and error.filename:
        return str(write_failure(error, "file", error.filename))
    if is_out_of_memory(error):
        return str(memory_failure(error, "during the run", "lower the model's size, local.batch_size or the clients per round"))
    return None


def essential(message: str) -> str:
    """Strip jsonargparse's union-type wrapping, keeping the setting's own message."""
    if "Union subtypes" not in message:
        return message
    reasons = [
        line.strip()[2:]
        for line in message.splitlines()
        if line.strip().startswith("- ") and "Expected a <class 'NoneType'>" not in line
    ]
    return "; ".join(reasons) or message
