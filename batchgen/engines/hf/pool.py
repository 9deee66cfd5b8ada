"""The requests of the hf engine's scheduler before and while they hold a slot: a Sequence is one request with its
sample's own draw (RNG, grammar matcher), its generated tokens and where its prefill starts; the Pool holds those
waiting for a slot, longest prompt first, topped up from the engine's request source."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from batchgen.engines.base import Source, take
from batchgen.engines.hf.prefix import Entry
from batchgen.engines.hf.sampling.sampler import Draw, Sampler
from batchgen.records import Request


@dataclass(slots=True)
class Sequence:
    request: Request
    draw: Draw  # the sample's own RNG and grammar matcher
    generated: list[int] = field(default_factory=list)
    start: int = 0  # prompt tokens taken from the prefix cache: its prefill starts here
    filled: int = 0  # a chunked prompt's tokens in its slot so far
    prefix: Optional[Entry] = None  # that cached prefix, until it is loaded into the slot
    arrived: float = field(default_factory=time.monotonic)  # taken from the source (its latency starts)

    @property
    def suffix(self) -> int:
        """Prompt tokens left to prefill."""
        return len(self.request.prompt_ids) - self.start


class Pool:
    """The requests waiting for a slot, longest prompt first (arrival order among equals), topped up from the
    source; `max_len` is the longest prompt + max_new_tokens seen, what the cache must hold."""

    def __init__(self, source: Source, sampler: Sampler):
        self.source = source
        self.sampler = sampler
        self.waiting: deque[Sequence] = deque()
        self.exhausted = False
        self.max_len = 0

    def top_up(self) -> None:
        if self.exhausted:
            return
        new, self.exhausted = take(self.source)
        if new:
            self.max_len = max(self.max_len, max(len(r.prompt_ids) + r.params.max_new_tokens for r in new))
            arrived = [Sequence(r, self.sampler.start(r)) for r in new]
            self.waiting = deque(sorted([*self.waiting, *arrived], key=lambda s: -len(s.request.prompt_ids)))
