"""Fewer OpenMP threads while other work holds the cores, all of them again when it leaves.

With OpenMP's threads spinning between the parallel regions of a step (runtime.set_openmp_defaults), a
step's CPU time is its threads' wall time as long as each has a core: the share `cpu / (wall * threads)`
is 0.9-1.0 on an idle machine. When other processes want the same cores, each thread gets part of one,
the spinning threads take time from the working ones, and every region waits for its slowest thread.
Measured on a 2-core Zen 5 EPYC with one other busy process: the share fell to 0.5 and a 64-row decode
step of the benchmark model took 73 ms with 2 threads against 21 ms idle; with 1 thread it took 40 ms
(benchmarks/threads.py measures whole jobs).

So the governor times the engine's steps (the scheduler enters it around each prefill and decode call) in
windows of WINDOW_S. A window whose share is below SHARE takes threads away (down to 1); while below the
configured count it tries them all again after PROBE_S, and after each probe that finds the cores still
busy waits twice as long (up to MAX_PROBE_S). Only where threads spin (runtime.openmp_spins): a thread
that sleeps while it waits has a low share on an idle machine too. What it cannot see: a core taken
from one of many threads (a 16-thread team with one busy neighbour keeps a share of 16/17).
Knows clocks and thread counts, not models or requests.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Optional

from batchgen.engines.hf.backends.cpu.runtime import openmp_spins

log = logging.getLogger(__name__)
WINDOW_S = 0.25  # timed step wall time per decision
SHARE = 0.75  # below this share of their cores the threads are contended (idle: 0.9-1.0; one busy neighbour of 2
# threads on 2 cores: 0.5)
PROBE_S = 5.0
MAX_PROBE_S = 80.0


class ThreadGovernor:
    """A context manager around each engine step (reentrant across steps, not nested)."""

    def __init__(self, threads: int, set_threads: Callable[[int], None], *,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] = time.process_time):
        self.full = self.threads = threads
        self._set_threads, self._clock, self._cpu_clock = set_threads, clock, cpu_clock
        self._wall = self._cpu = 0.0
        self._start = self._start_cpu = 0.0
        self._probing = False
        self._probe_at: Optional[float] = None
        self._backoff = PROBE_S
        self.changes = 0  # thread-count changes so far (tests, logs)

    def __enter__(self) -> ThreadGovernor:
        self._start, self._start_cpu = self._clock(), self._cpu_clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wall += self._clock() - self._start
        self._cpu += self._cpu_clock() - self._start_cpu
        if self._wall >= WINDOW_S:
            share = self._cpu / (self._wall * self.threads)
            self._wall = self._cpu = 0.0
            self._decide(share)

    def _decide(self, share: float) -> None:
        now = self._clock()
        if share < SHARE and self.threads > 1:
            fewer = max(1, self.threads - math.ceil(self.threads * (1 - share)))
            if self._probing:
                self._backoff = min(self._backoff * 2, MAX_PROBE_S)
            self._probing = False
            self._probe_at = now + self._backoff
            self._change(fewer, f"other work holds the cores (the engine's threads got {share:.0%} of theirs over "
                                f"{WINDOW_S:g} s): {self.threads} -> {fewer} threads, all {self.full} tried again in "
                                f"{self._backoff:g} s")
        elif self._probing:  # the probe's window found the cores free
            self._probing, self._probe_at, self._backoff = False, None, PROBE_S
            log.debug("hf engine: the cores are free again (share %.0f%%): %d threads", share * 100, self.threads)
        elif self.threads < self.full and self._probe_at is not None and now >= self._probe_at:
            self._probing = True
            self._change(self.full, f"trying all {self.full} threads again")

    def _change(self, threads: int, why: str) -> None:
        (log.info if self.changes == 0 else log.debug)("hf engine: %s", why)
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)


def for_engine(threads: int, set_threads: Callable[[int], None]) -> Optional[ThreadGovernor]:
    """A governor for an engine on CPU with `threads` OpenMP threads, where it can tell contention (threads spin
    while they wait) and is not turned off (BATCHGEN_ADAPT_THREADS=0); None otherwise."""
    if threads < 2 or not openmp_spins() or os.environ.get("BATCHGEN_ADAPT_THREADS", "1") == "0":
        return None
    return ThreadGovernor(threads, set_threads)
