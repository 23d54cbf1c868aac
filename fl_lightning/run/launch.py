"""How ``fl-lightning`` starts the other ranks of a DDP run, and why no rank waits forever.

Lightning's ``_SubprocessScriptLauncher`` starts local ranks 1..P-1 by running ``sys.argv``
again. ``fl-lightning`` hands LightningCLI its arguments explicitly (and ``compare`` runs fits
inside its own process), so that command line is not the fit: ``RelaunchCommand`` starts
``python -m fl_lightning.commands.cli <the fit's own arguments>`` instead, with Lightning's environment
(MASTER_ADDR, MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE). Ranks started by torchrun or
SLURM (``creates_processes_externally``) start nothing, as with Lightning's launcher.

Every rank also runs ``RankWatch`` (docs/cluster.md, "When a rank fails"):

- the rendezvous gets ``FL_LIGHTNING_RENDEZVOUS_TIMEOUT`` seconds (default 300) to form the
  process group; past it, the rank stops naming the address and the ranks expected;
- a launching rank watches the ranks it started: one that exits with an error or is killed, or
  that ends before the process group formed, stops every rank;
- a started rank whose launching rank ended stops;
- a launching rank that fails (e.g. MASTER_PORT in use) ends the ranks it started.

Each stop is one line naming the rank and the cause, exit code 2. A rank blocked in a
collective cannot raise, so the watch prints the line and ends the process itself; a rank whose
collective raised (gloo's "Connection closed by peer" when a peer died) raises ``RankFailed``
naming the peer instead of the transport's traceback.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from fl_lightning.core.errors import KNOWN_ERRORS, RankFailed, one_line

TIMEOUT_ENV = "FL_LIGHTNING_RENDEZVOUS_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
LAUNCHER_ENV = "FL_LIGHTNING_LAUNCHER"  # "<pid> <global rank>" of the rank that started this one
POLL_S = 0.25
GRACE_S = 3.0  # a failure the main thread can raise itself is reported by it (with its own message)
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def rendezvous_timeout() -> float:
    """``FL_LIGHTNING_RENDEZVOUS_TIMEOUT`` in seconds (> 0), default 300."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: seconds the ranks wait to form the process group, a number > 0 (default {DEFAULT_TIMEOUT_S:g})")
    return value


def exit_cause(code: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` (Popen's negative code)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _process_group_formed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


class RankWatch(threading.Thread):
    """Ends this process with one line (exit 2) when the run cannot go on and the main thread is stuck:
    the rendezvous past its timeout, a started rank that failed, or the launching rank gone."""

    def __init__(self, rank: int, world: int, children: Sequence[tuple[int, subprocess.Popen]], timeout: float) -> None:
        super().__init__(daemon=True, name="fl-lightning-rank-watch")
        self.rank, self.world, self.children, self.timeout = rank, world, list(children), timeout
        launcher = os.environ.get(LAUNCHER_ENV, "").split()
        self.launcher = (int(launcher[0]), int(launcher[1])) if len(launcher) == 2 else None
        self.active = True  # while a launch runs its function; after it, the ranks end in their own time
        self.formed = False

    def failure(self, raised: bool = False) -> str | None:
        """Why this rank cannot go on, or None. A launching rank that ended counts before the process group
        formed, or when this rank's own collective ``raised`` (after a finished run it may end first)."""
        for rank, proc in self.children:
            code = proc.poll()
            if code is not None and (code != 0 or not self.formed):
                when = "" if self.formed else " before the process group formed"
                return f"rank {rank} (pid {proc.pid}) {exit_cause(code)}{when}; every rank stops (its own error, if any, is above)"
        if self.launcher is not None and (raised or not self.formed) and os.getppid() != self.launcher[0]:
            return f"rank {self.rank}: rank {self.launcher[1]} (pid {self.launcher[0]}), which started it, ended; this rank stops"
        return None

    def run(self) -> None:
        start = time.monotonic()
        while True:
            time.sleep(POLL_S)
            if not self.active:  # between two launches of one run (fit, then test), or after the last
                continue
            self.formed = self.formed or _process_group_formed()
            reason = self.failure()
            if reason is None and not self.formed and time.monotonic() - start > self.timeout:
                reason = (
                    f"rank {self.rank}: the process group of {self.world} ranks did not form within {self.timeout:g} s "
                    f"(rendezvous at {_address()}): a rank did not start, failed before joining, or cannot reach that "
                    f"address; {TIMEOUT_ENV} sets the wait in seconds"
                )
            if reason is not None:
                time.sleep(GRACE_S)
                if self.active:
                    self.stop(reason)

    def stop(self, reason: str) -> None:
        end_children(self.children, wait_s=0.0)
        print(f"fl-lightning: error: {reason}", file=sys.stderr, flush=True)
        os._exit(2)


def end_children(children: Sequence[tuple[int, subprocess.Popen]], wait_s: float) -> None:
    """Give the started ranks ``wait_s`` seconds to end by themselves, then SIGKILL the rest."""
    deadline = time.monotonic() + wait_s
    for _, proc in children:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()


class RelaunchCommand(_SubprocessScriptLauncher):
    """Lightning's launcher for DDP, starting the other local ranks with ``fl-lightning <args>``."""

    def __init__(self, launcher: _SubprocessScriptLauncher, args: Sequence[str]) -> None:
        super().__init__(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
        self.args = [str(a) for a in args]
        self.watch: RankWatch | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "fl_lightning.commands.cli", *self.args]

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        environment = self.cluster_environment
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["NODE_RANK"] = str(environment.node_rank())
        os.environ["LOCAL_RANK"] = str(environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        seeded = os.environ.get("PL_GLOBAL_SEED") is not None
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank), LAUNCHER_ENV: f"{os.getpid()} {environment.global_rank()}"}
            if not seeded:
                env.pop("PL_GLOBAL_SEED", None)
            self.procs.append(subprocess.Popen(self.command(), env=env))

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        timeout = rendezvous_timeout()
        environment = self.cluster_environment
        environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not environment.creates_processes_externally:
            self._call_children_scripts()
        first = environment.global_rank()
        children = [(first + i + 1, proc) for i, proc in enumerate(self.procs)]
        if self.watch is None:  # once per run (trainer.test after fit launches again, starting nothing)
            self.watch = RankWatch(first, self.num_processes * self.num_nodes, children, timeout)
            self.watch.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        self.watch.active = True
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            self.watch.active = False
            end_children(children, wait_s=GRACE_S)
            raise self.explained(error, first, self.watch) from error
        finally:
            self.watch.active = False

    @staticmethod
    def explained(error: BaseException, rank: int, watch: RankWatch) -> BaseException:
        """``error``, or a one-line error naming the rank and cause where the transport's says less."""
        if isinstance(error, KNOWN_ERRORS) or not isinstance(error, Exception):
            return error
        text = str(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            return ValueError(
                f"rank {rank}: MASTER_PORT {os.environ.get('MASTER_PORT')} is in use on {os.environ.get('MASTER_ADDR')} "
                "(EADDRINUSE): export MASTER_PORT=<a free port>, or leave it unset on one machine for a free one"
            )
        reason = watch.failure(raised=True)
        if reason is not None:
            return RankFailed(reason)
        if any(marker in text for marker in LOST_PEER):
            return RankFailed(f"rank {rank} lost its connection to another rank ({one_line(error)}); every rank stops: "
                              "the rank that ended first says why")  # fmt: skip
        return error


def install(trainer: Any, args: Sequence[Any]) -> None:
    """Give a DDP trainer ``RelaunchCommand`` (other strategies, one process, or ``args`` that are not a
    command line: nothing changes)."""
    strategy = trainer.strategy
    launcher = getattr(strategy, "_launcher", None)
    if type(launcher) is not _SubprocessScriptLauncher or not all(isinstance(a, (str, int, float)) for a in args):
        return
    strategy._launcher = RelaunchCommand(launcher, args)
