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
    """SIGTERM arrived during a round: the run stops within one local step (the round is not aggregated)."""


def interrupted(round_idx: int, client_id: int, step: int, steps: int) -> RunInterrupted:
    return RunInterrupted(
        f"round {round_idx}: stopped by SIGTERM during client {client_id}'s local step {step + 1} of {steps}; "
        "the round is not aggregated; resume from the last checkpoint (--ckpt_path last)"
    )


KNOWN_ERRORS: tuple[type[BaseException], ...] = (ValueError, FLError)
"""What the command line reports in one line (exit code 2) instead of a traceback."""


def one_line(error: BaseException) -> str:
    """``TypeName: first line of the message`` (error messages of torch span many lines)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0].strip()}" if text else type(error).__name__
