"""Graceful stop on SIGTERM (Slurm preemption, `kill`) and SIGINT (Ctrl-C).

While a job runs, the first signal raises `StopRequested` in the main thread at once, unless the
job is inside a `shielded()` section (a journal frame, a part commit, a status write): then it is
raised when that section ends. So the job stops taking new work within one engine step, the
results already journaled stay on disk, and nothing is left half-written under a final name.
A second signal exits at once (what is journaled is safe against that too). Knows signals, not jobs.

`Reaper` is the other half of stopping: a small watcher process that, once its parent is gone however it died
(SIGKILL included), kills every process that inherited the parent's mark, e.g. a local Ray cluster's daemons and
the agents they start, which outlive a dead driver otherwise. `python -m batchgen.run.stopping MARK` is that watcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from types import FrameType
from typing import Any, Optional

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """The job was asked to stop by a signal; exit code 128 + signal number (143 SIGTERM, 130 SIGINT).

    A BaseException, like KeyboardInterrupt, so that `except Exception` handlers do not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class GracefulStop:
    """Installs the handlers for its `with` block and restores the previous ones after it."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None  # the first signal received
        self._depth = 0  # nesting of shielded() sections
        self._pending = False  # a signal arrived inside a shielded section
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def rearm(self) -> None:
        """Install the handlers again, after a library replaced them (ray.init sets its own SIGTERM handler, which
        exits without journaling); the handlers restored at the end stay the ones found on entering."""
        if self._previous and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """A section that a signal must not cut in half; the stop is raised when it ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._pending:
            self._pending = False
            raise StopRequested(self.signum or signal.SIGTERM)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.signum = signum
        log.warning("%s received: stopping after journaling finished results", signal.Signals(signum).name)
        if self._depth:
            self._pending = True
        else:
            raise StopRequested(signum)


MARK_ENV = "BATCHGEN_REAPER_MARK"  # inherited by every process started inside Reaper.marking()
REAP_GRACE_S = 3.0  # between the SIGTERM and the SIGKILL of a marked process
REAP_SETTLE_S = 0.5  # between the two empty sweeps that end a reap
REAP_GIVE_UP_S = 30.0  # SIGKILL sweeps at most this long
WATCH_POLL_S = 0.5  # how often the watcher notes the marked processes' descendants (family)


class Reaper:
    """Leaves no process behind that this one started inside `marking()`: they inherit MARK_ENV, and a watcher
    process (its own session, so a terminal's Ctrl-C or a group kill does not take it first) waits for the pipe
    from this process to close (this process exited or died, or `close()`), then SIGTERMs every process carrying
    the mark, and SIGKILLs those left after REAP_GRACE_S. Linux only (it reads /proc/PID/environ); elsewhere
    nothing is watched."""

    def __init__(self) -> None:
        self.mark = f"{os.getpid()}-{uuid.uuid4().hex}"
        self._watcher: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> Reaper:
        if os.path.isdir("/proc"):
            env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
            # its own stdout/stderr: a pipe reading this job's output (`| tee`) ends with the job, not the sweep
            self._watcher = subprocess.Popen([sys.executable, "-m", "batchgen.run.stopping", self.mark], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
        return self

    @contextlib.contextmanager
    def marking(self) -> Iterator[None]:
        """Processes started in this block carry the mark (and pass it on to theirs)."""
        previous = os.environ.get(MARK_ENV)
        os.environ[MARK_ENV] = self.mark
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(MARK_ENV, None)
            else:
                os.environ[MARK_ENV] = previous

    def close(self) -> None:
        """Reap now (what is left of the marked processes), without waiting for the watcher."""
        if self._watcher is not None and self._watcher.stdin is not None:
            self._watcher.stdin.close()


def marked(mark: str) -> list[int]:
    """The pids (other than this one) whose environment carries MARK_ENV=mark."""
    needle = f"{MARK_ENV}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:  # exited meanwhile, or not ours to read
                continue
    return pids


def _stat(pid: int) -> Optional[tuple[int, int, int]]:
    """(parent pid, start time in clock ticks, resident pages) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), int(fields[21])
    except (OSError, IndexError, ValueError):
        return None


def process_table() -> dict[int, tuple[int, int, int]]:
    """Every live process: pid -> (parent pid, start time, resident pages), from /proc."""
    return {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := _stat(int(e))) is not None}


def descendants(roots: set[int], table: dict[int, tuple[int, int, int]]) -> set[int]:
    """`roots` and every process below them in `table` (process_table)."""
    found, frontier = set(roots), list(roots)
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _, _) in table.items() if ppid == parent and pid not in found]
        found.update(children)
        frontier.extend(children)
    return found


def family(mark: str) -> dict[int, int]:
    """The marked processes and all their descendants, pid -> start time. A descendant may not carry the mark: a
    process that renames itself (Ray's agents, by setproctitle) can overwrite the memory /proc/PID/environ reads,
    and a child may be started with an environment of its own; once its parent dies it is an orphan of init, so
    its lineage has to be noted while the parent lives."""
    table = process_table()
    found = descendants({pid for pid in marked(mark) if pid in table}, table) - {os.getpid()}
    return {pid: table[pid][1] for pid in found}


def _targets(mark: str, known: dict[int, int]) -> set[int]:
    """Marked processes, and those noted in `known` that still run (the same start time: not a reused pid)."""
    alive = {pid for pid, start in known.items() if (st := _stat(pid)) is not None and st[1] == start}
    return set(marked(mark)) | alive


def reap(mark: str, grace_s: float = REAP_GRACE_S, give_up_s: float = REAP_GIVE_UP_S,
         known: Optional[dict[int, int]] = None) -> None:
    """SIGTERM every marked process (and each noted descendant in `known`), and again each new one, for grace_s; then
    SIGKILL what is left until a sweep finds none twice in a row, REAP_SETTLE_S apart (a dying process may have
    started another meanwhile: a worker its compiler, a raylet an agent), giving up after give_up_s (a process that
    survives SIGKILL that long is stuck in the kernel, not ours to wait for)."""
    known = known if known is not None else {}
    signalled: set[int] = set()
    deadline = time.monotonic() + grace_s
    while (pids := _targets(mark, known)) and time.monotonic() < deadline:
        for pid in pids - signalled:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        signalled |= pids
        time.sleep(0.1)
    deadline, quiet = time.monotonic() + give_up_s, 0
    while quiet < 2 and time.monotonic() < deadline:
        pids = _targets(mark, known)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        quiet = 0 if pids else quiet + 1
        time.sleep(0.1 if pids else REAP_SETTLE_S)


def _watch(mark: str) -> None:
    import select

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the job, which then closes the pipe
    known: dict[int, int] = {}
    stdin = sys.stdin.buffer
    while True:  # until EOF: the parent closed the pipe or is gone; meanwhile note the marked processes' family
        ready, _, _ = select.select([stdin], [], [], WATCH_POLL_S)
        if ready and not os.read(stdin.fileno(), 65536):
            break
        known.update(family(mark))
    reap(mark, known=known)


if __name__ == "__main__":
    _watch(sys.argv[1])
