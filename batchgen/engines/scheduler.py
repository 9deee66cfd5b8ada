"""Continuous batching for the hf engine.

Requests wait in order of prompt length, longest first (an OOM shows at once). Whenever slots are
free, the next waiting requests are prefilled together as one bucket under the token budget; every
step then decodes all live sequences together. A sequence leaves the batch the step it finishes
(EOS, stop string or its own cap) and its slot goes to a waiting one, so no step is spent on a
finished row. Results come back in request order. Knows requests and a stepper, not model internals.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

import torch

from batchgen.records import Request, Result

log = logging.getLogger(__name__)
PAD_RATIO = 0.75  # a prefill group's shortest prompt is at least this fraction of its longest
R = TypeVar("R")


@dataclass(slots=True)
class Sequence:
    index: int  # position of its request in the window
    request: Request
    generator: Optional[torch.Generator]  # the sample's own RNG; None for greedy
    generated: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    decode_steps: int = 0  # forward passes of the decode loop
    decode_row_steps: int = 0  # rows computed over all decode steps (each one a useful token)
    prefill_rows: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled
    prefill_padded_tokens: int = 0  # prompt tokens plus bucket padding
    oom_backoffs: int = 0


class Scheduler:
    def __init__(self, engine: Any, stepper: Any, *, max_batch_tokens: int, max_batch_size: int):
        self.engine = engine  # picks tokens and decides finishing (sampling, EOS, stop strings)
        self.stepper = stepper  # prefill / decode on a SlotKVCache
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.stats = SchedulerStats()

    def run(self, requests: list[Request], on_result: Optional[Callable[[Result], None]]) -> list[Result]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
        waiting = deque(order)
        results: list[Optional[Result]] = [None] * len(requests)
        max_len = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        cache = self._allocate(min(self.max_batch_size, len(requests)), max_len)
        live: list[Sequence] = []

        def finish(seq: Sequence, reason: str) -> None:
            results[seq.index] = self.engine.make_result(seq.request, seq.generated, reason)
            if on_result is not None:
                on_result(results[seq.index])

        while waiting or live:
            admitted = self._admit(waiting, requests, len(live), cache.slots)
            if admitted:
                logits = self._prefill_groups(cache, len(live), admitted)
                live += admitted
                self._advance(logits, live[len(live) - len(admitted):], len(live) - len(admitted), cache, live,
                              finish)
            if live:
                tokens = torch.tensor([s.generated[-1] for s in live], device=self.stepper.device)
                logits = self.stepper.decode(cache, tokens)
                self.stats.decode_steps += 1
                self.stats.decode_row_steps += len(live)
                self._advance(logits, list(live), 0, cache, live, finish)
        return results  # type: ignore[return-value]

    def _allocate(self, slots: int, max_len: int) -> Any:
        """The window's KV cache; if it does not fit, halve the slots (engine.max_batch_size) until it does."""
        while True:
            try:
                return self.stepper.new_cache(slots, max_len)
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if slots == 1 or not is_oom(exc):
                    raise
                slots = self.max_batch_size = max(slots // 2, 1)
                self.stats.oom_backoffs += 1
                log.warning("out of memory allocating the KV cache; engine.max_batch_size lowered to %d", slots)

    def _admit(self, waiting: deque, requests: list[Request], n_live: int, slots: int) -> list[Sequence]:
        """Next waiting requests for the free slots, as long as their padded prefill fits the token budget."""
        admitted: list[Sequence] = []
        width = 0
        while waiting and n_live + len(admitted) < slots:
            req = requests[waiting[0]]
            width = max(width, len(req.prompt_ids))
            if admitted and (len(admitted) + 1) * width > self.max_batch_tokens:
                break
            index = waiting.popleft()
            admitted.append(Sequence(index, req, self.engine.generator(req)))
        return admitted

    def _prefill_groups(self, cache: Any, first_slot: int, admitted: list[Sequence]) -> torch.Tensor:
        """Prefill admitted rows (longest first) in groups of similar length, so padding stays under ~25%."""
        logits, start = [], 0
        while start < len(admitted):
            width = len(admitted[start].request.prompt_ids)
            end = start + 1
            while end < len(admitted) and len(admitted[end].request.prompt_ids) >= PAD_RATIO * width:
                end += 1
            logits.append(self._prefill(cache, first_slot + start, admitted[start:end]))
            start = end
        return torch.cat(logits)

    def _prefill(self, cache: Any, first_slot: int, admitted: list[Sequence]) -> torch.Tensor:
        """Prefill a bucket; on out-of-memory halve the token budget and prefill it in halves."""
        def run(start: int, stop: int) -> torch.Tensor:
            prompts = [s.request.prompt_ids for s in admitted[start:stop]]
            logits = self.stepper.prefill(cache, first_slot + start, prompts)
            self.stats.prefill_rows += len(prompts)
            self.stats.prefill_tokens += sum(len(p) for p in prompts)
            self.stats.prefill_padded_tokens += len(prompts) * max(len(p) for p in prompts)
            return logits

        def on_oom(rows: int) -> None:
            self.stats.oom_backoffs += 1
            self.max_batch_tokens = max(self.max_batch_tokens // 2, 1)
            log.warning("out of memory prefilling %d rows; engine.max_batch_tokens lowered to %d and retrying",
                        rows, self.max_batch_tokens)

        return torch.cat(halve_on_oom(len(admitted), run, on_oom))

    def _advance(self, logits: torch.Tensor, stepped: list[Sequence], first_slot: int, cache: Any,
                 live: list[Sequence], finish: Callable[[Sequence, str], None]) -> None:
        """Append each stepped sequence's next token; retire the finished ones, compacting the slots."""
        tokens = self.engine.pick(logits, [s.request for s in stepped], [s.generator for s in stepped])
        done: list[int] = []
        for j, (seq, token) in enumerate(zip(stepped, tokens)):
            seq.generated.append(token)
            reason = self.engine.finish_reason(seq.request.params, seq.generated)
            if reason is not None:
                finish(seq, reason)
                done.append(first_slot + j)
        for slot in sorted(done, reverse=True):  # fill each hole with the last live sequence
            last = len(live) - 1
            if slot != last:
                cache.move(last, slot)
                live[slot] = live[last]
            live.pop()


def halve_on_oom(count: int, run: Callable[[int, int], R], on_oom: Callable[[int], None], start: int = 0) -> list[R]:
    """[run(start, start + count)]; if that runs out of memory and holds more than one item, on_oom(count) (lower
    the budget, log, count) and the same for each half, recursively. The outputs of the calls that ran, in order:
    the prefill and the generic path both back off this way."""
    try:
        return [run(start, start + count)]
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if count == 1 or not is_oom(exc):
            raise
    on_oom(count)
    half = count // 2
    return halve_on_oom(half, run, on_oom, start) + halve_on_oom(count - half, run, on_oom, start + half)


def is_oom(exc: BaseException) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError saying it cannot allocate."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text
