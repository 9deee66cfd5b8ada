"""Graceful stop on SIGTERM (Slurm preemption, `kill`) and SIGINT (Ctrl-C).

While a job runs, the first signal raises `StopRequested` in the main thread at once, unless the
job is inside a `shielded()` section (a journal frame, a part commit, a status write): then it is
raised when that section ends. So the job stops taking new work within one engine step, the
results already journaled stay on disk, and nothing is left half-written under a final name.
A second signal exits at once (what is journaled is safe against that too). Knows signals, not jobs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
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
