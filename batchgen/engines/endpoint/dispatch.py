"""Sending requests to an endpoint with adaptive concurrency, retries and a bounded stop.

`Dispatcher.run(source, on_result)` is an engine's `stream`: it keeps up to `Window.limit` requests in flight on a
pool of daemon threads, each making one attempt (`send`), and hands every final Result to `on_result` on the calling
thread as it arrives, so that the runner journals it at once (a SIGKILL loses only the requests in flight).

- Concurrency adapts as llm-d's dispatcher and TCP do: one more slot per window of successes (additive increase),
  half as many on a 429, a 503 or a timeout (multiplicative decrease, once per congestion event: failures of
  attempts sent before the last decrease do not count again), and no new attempt before a `Retry-After`.
- A transient failure is retried after exponential backoff with jitter (never sooner than `Retry-After`), up to
  `max_retries` times; then, if other requests were answered meanwhile, the request alone failed (an
  `endpoint_failed` error row), else the endpoint counts as down and the job stops (EndpointDown, exit 1) after the
  results already final are handed on.
- Anything that stops the run (a signal's StopRequested, an error) first stops sending, then waits up to
  `stop_grace_s` for the attempts in flight and hands on those that finish.

Knows attempts, outcomes and time, not HTTP (engine.py's `send` turns a response into an Outcome).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from batchgen.engines.base import Source, starved
from batchgen.errors import BatchgenError
from batchgen.records import Request, Result

log = logging.getLogger(__name__)
BACKOFF_BASE_S = 0.5  # the first retry's delay (before jitter); doubled each attempt
BACKOFF_CAP_S = 30.0


class EndpointDown(BatchgenError):
    """A request failed transiently more than engine.max_retries times in a row: the endpoint is down or refuses
    every attempt. Results handed on before are journaled; a rerun resumes."""

    exit_code = 1


@dataclass(slots=True)
class Outcome:
    """One attempt's end: a final Result (a generation, or an error row's Result), or a transient failure."""

    result: Optional[Result] = None
    transient: Optional[str] = None  # why the attempt should be retried (status or network error)
    overload: bool = False  # the server said it is overloaded (429, 503) or the attempt timed out
    retry_after: Optional[float] = None  # seconds the server asked to wait


def failed(req: Request, attempts: int, why: Optional[str]) -> Result:
    """A request that failed transiently on every attempt while other requests were answered: an error row of its
    own (endpoint_failed, retryable), not a dead job."""
    return Result(key=req.key, text="", finish_reason="error", num_prompt_tokens=len(req.prompt_ids),
                  num_generated_tokens=0, error=f"endpoint_failed: {attempts} attempts, the last: {why}")


class Window:
    """The adaptive concurrency limit (AIMD) and the server's Retry-After hold."""

    def __init__(self, most: int):
        self.most = most
        self.limit = float(most)
        self.hold_until = 0.0  # no attempt starts before this time (monotonic)
        self.decreased_at = -1.0  # when the limit was last halved (monotonic)

    @property
    def slots(self) -> int:
        return max(1, int(self.limit))

    def succeeded(self) -> None:
        before = self.slots
        self.limit = min(float(self.most), self.limit + 1.0 / self.limit)
        if self.slots == self.most and before < self.most:
            log.info("endpoint: concurrency back to %d", self.most)

    def overloaded(self, sent_at: float, why: str, retry_after: Optional[float], now: float) -> None:
        if retry_after:
            self.hold_until = max(self.hold_until, now + retry_after)
        if sent_at < self.decreased_at:
            return  # sent before the last decrease: the same congestion event
        before = self.slots
        self.limit = max(1.0, self.limit / 2)
        self.decreased_at = now
        log.info("endpoint: %s; concurrency %d -> %d%s", why, before, self.slots,
                 f", waiting {retry_after:g} s as the server asked" if retry_after else "")


@dataclass(order=True)
class _Due:
    at: float
    order: int
    request: Request = None  # type: ignore[assignment]
    attempt: int = 0


class _Run:
    """One run's state: the requests waiting (for a slot or their retry time, soonest first) and in flight."""

    def __init__(self, source: Source):
        self.source = source
        self.pending: list[_Due] = []
        self.order = itertools.count()
        self.in_flight = 0
        self.exhausted = False
        self.first_sent: dict[int, float] = {}  # request key -> its first attempt's start (its latency starts)
        # this run's finished attempts: an attempt of an earlier run (stopped with it in flight) lands in that run's
        # queue, never in this one, whose keys may be the same numbers
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.last_success = -1.0  # when an answer last came back (monotonic)
        self.first_failed: dict[int, float] = {}  # request key -> when its first attempt failed

    def push(self, request: Request, at: float, attempt: int = 0) -> None:
        heapq.heappush(self.pending, _Due(at, next(self.order), request, attempt))


class Dispatcher:
    def __init__(self, send: Callable[[Request], Outcome], *, most: int, max_retries: int, stop_grace_s: float):
        self.send = send
        self.window = Window(most)
        self.max_retries = max_retries
        self.stop_grace_s = stop_grace_s
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"batchgen-endpoint-{i}")
                        for i in range(most)]
        for thread in self.threads:
            thread.start()
        self.counts = {"sent": 0, "retried": 0}

    def close(self) -> None:
        for _ in self.threads:
            self.tasks.put(None)

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            due, sent_at, done = task
            try:
                outcome: Outcome | Exception = self.send(due.request)
            except Exception as exc:  # a bug in building or reading a request: raised on the run's thread
                outcome = exc
            done.put((due, sent_at, outcome))

    def run(self, source: Source, on_result: Callable[[Result], None]) -> None:
        run = _Run(source)
        try:
            while True:
                self._start_due(run)
                if not run.in_flight and not run.pending:
                    if run.exhausted:
                        return
                    if time.monotonic() < self.window.hold_until:  # the server's Retry-After: wait, then ask
                        time.sleep(self.window.hold_until - time.monotonic())
                        continue
                    raise starved()
                # wait for an attempt to finish, or until the next pending request may start where a slot is free
                wake = (max(run.pending[0].at, self.window.hold_until)
                        if run.pending and run.in_flight < self.window.slots else None)
                due, sent_at, outcome = self._next(run, wake)
                if due is None:
                    continue
                run.in_flight -= 1
                retry = self._settle(due, sent_at, outcome, on_result, run)
                if retry is not None:
                    run.push(due.request, retry, due.attempt + 1)
        except BaseException:
            self._drain(run, on_result)
            raise

    def _start_due(self, run: _Run) -> None:
        """Start pending requests that are due while slots are free (and the server's hold is over), asking the
        source for more whenever none is due."""
        now = time.monotonic()
        while run.in_flight < self.window.slots and now >= self.window.hold_until:
            if (not run.pending or run.pending[0].at > now) and not run.exhausted:
                batch = run.source()
                run.exhausted = batch is None
                for request in batch or ():
                    run.push(request, now)
                if not batch and not run.pending:
                    return
            if not run.pending or run.pending[0].at > now:
                return
            due = heapq.heappop(run.pending)
            run.first_sent.setdefault(due.request.key, now)
            self.tasks.put((due, now, run.done))
            self.counts["sent"] += 1
            run.in_flight += 1

    def _next(self, run: _Run, wake: Optional[float]) -> tuple[Optional[_Due], float, Outcome | Exception]:
        """The next finished attempt; (None, ...) when `wake` comes first."""
        timeout = None if wake is None else max(0.0, wake - time.monotonic())
        try:
            return run.done.get(timeout=timeout)
        except queue.Empty:
            return None, 0.0, Outcome()

    def _settle(self, due: _Due, sent_at: float, outcome: Outcome | Exception, on_result: Callable[[Result], None],
                run: _Run) -> Optional[float]:
        """Hand a final Result on (its latency from the first attempt), or say when to retry (None: settled)."""
        if isinstance(outcome, Exception):
            raise outcome
        now = time.monotonic()
        if outcome.result is not None:
            self.window.succeeded()
            run.last_success = now
            run.first_failed.pop(due.request.key, None)
            outcome.result.latency_s = now - run.first_sent.pop(due.request.key, sent_at)
            on_result(outcome.result)
            return None
        if outcome.overload:
            self.window.overloaded(sent_at, outcome.transient or "overloaded", outcome.retry_after, now)
        failing_since = run.first_failed.setdefault(due.request.key, now)
        if due.attempt >= self.max_retries:
            run.first_failed.pop(due.request.key, None)
            if run.last_success > failing_since:  # others answered while it kept failing: it fails, not the endpoint
                run.first_sent.pop(due.request.key, None)
                on_result(failed(due.request, due.attempt + 1, outcome.transient))
                return None
            raise EndpointDown(f"the endpoint failed request {due.request.key} {due.attempt + 1} times in a row "
                               f"(last: {outcome.transient}) with no other answer meanwhile; the results so far are "
                               f"journaled: rerun the same command to resume once the endpoint is up "
                               f"(engine.max_retries={self.max_retries})")
        self.counts["retried"] += 1
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** due.attempt) * random.uniform(0.5, 1.0)
        log.debug("endpoint: request %d: %s; retry %d in %.2f s", due.request.key, outcome.transient,
                  due.attempt + 1, delay)
        return now + max(delay, outcome.retry_after or 0.0)

    def _drain(self, run: _Run, on_result: Callable[[Result], None]) -> None:
        """After a stop or an error: send nothing more; hand on what finishes within stop_grace_s. A failure handing
        one on ends the drain (logged); the run's own exception is the one raised."""
        deadline = time.monotonic() + self.stop_grace_s
        in_flight = run.in_flight
        if in_flight:
            log.warning("endpoint: waiting up to %g s for %d requests in flight", self.stop_grace_s, in_flight)
        while in_flight and (left := deadline - time.monotonic()) > 0:
            try:
                due, _, outcome = run.done.get(timeout=left)
            except queue.Empty:
                break
            in_flight -= 1
            if isinstance(outcome, Outcome) and outcome.result is not None:
                try:
                    on_result(outcome.result)
                except BaseException as exc:  # noqa: BLE001 - the original stop or error goes on up
                    log.warning("endpoint: a result could not be handed on while stopping (%s: %s); %d left "
                                "undelivered", type(exc).__name__, exc, in_flight)
                    return
        if in_flight:
            log.warning("endpoint: %d requests still in flight after %g s are dropped (a rerun sends them again)",
                        in_flight, self.stop_grace_s)
