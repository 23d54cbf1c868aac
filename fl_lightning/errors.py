"""Known failures of a run.

Each is raised with one line that says what went wrong, where, and what to do; the
``fl-lightning`` command prints that line and exits with code 2 (``KNOWN_ERRORS``).
Set ``FL_LIGHTNING_TRACEBACK=1`` for the full traceback.
"""

from __future__ import annotations


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
