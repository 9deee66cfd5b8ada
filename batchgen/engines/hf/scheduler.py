"""Continuous batching for the hf engine.

Requests wait in a pool in order of prompt length, longest first (an OOM shows at once). The pool is
topped up from the request source before every step, as far as the source gives (the job bounds it by
its look-ahead of parts), so the next parts' rows join the batch while the current part's last rows
finish, and rows of several parts are bucketed together. Whenever slots are free, the next waiting
requests are prefilled together as one bucket under the token budget; every step then decodes all
live sequences together. A sequence leaves the batch the step it finishes (EOS, stop string or its own
cap) and its slot goes to a waiting one, so no step is spent on a finished row. The KV cache grows (slots
up to engine.max_batch_size, positions to the longest request seen) as requests arrive.

No forward pass goes past the token budget: a prompt longer than engine.max_batch_tokens is prefilled a chunk per
step (each chunk attending over the earlier ones in its slot, the cache's last), with the live rows' decode steps in
between, so one long prompt does not stall the batch. Finished rows are handed on (their results made and given to
the job, which journals and commits them) after the next decode step is launched: on a GPU, whose kernels run
asynchronously, the host does that bookkeeping while the step runs. Knows requests, a
Sampler (token choice, finishing), a stepper (prefill and decode on the cache) and a context it enters around
each of their calls (on CPU, the thread governor that times them), not model internals.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from batchgen.engines.base import Source, generate_by_stream, starved
from batchgen.engines.hf.kvcache import SlotKVCache
from batchgen.engines.hf.oom import halve_on_oom, is_oom
from batchgen.engines.hf.pool import Pool, Sequence
from batchgen.engines.hf.prefix import PrefixCache
from batchgen.engines.hf.sampling.sampler import Sampler
from batchgen.records import Request, Result

log = logging.getLogger(__name__)
PAD_RATIO = 0.75  # a prefill group's shortest prompt is at least this fraction of its longest
LEN_STEP = 64  # the cache's positions grow in steps of this many: a slightly longer request does not reallocate


@dataclass(slots=True)
class SchedulerStats:
    decode_steps: int = 0  # forward passes of the decode loop
    decode_row_steps: int = 0  # rows computed over all decode steps (each one a useful token)
    prefill_rows: int = 0
    prefill_tokens: int = 0  # real prompt tokens prefilled
    prefill_padded_tokens: int = 0  # prompt tokens plus bucket padding
    prefill_chunks: int = 0  # prefill passes over part of a prompt longer than engine.max_batch_tokens
    oom_backoffs: int = 0
    prefix_tokens_reused: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    prefix_tokens_computed: int = 0  # tokens of shared prefixes prefilled once (included in prefill_tokens)
    prefix_cache_bytes: int = 0  # the prefix cache's keys and values held (engine.prefix_cache_mb bounds it)
    kv_slots: int = 0  # the KV cache's slots (rows decoded together at most), as last allocated
    kv_positions: int = 0  # and its positions per slot
    kv_cache_bytes: int = 0  # and its keys and values, every layer


class Stepper(Protocol):
    """Prefill and decode on a slot KV cache (step.LlamaStepper): what the scheduler drives."""

    device: torch.device
    kv_budget_bytes: Optional[int]  # the most the KV cache may hold (sized from free device memory); None: unbounded
    packed_prefill: bool  # prefill pads nothing: group prompts by the token budget alone, not by similar length

    def new_cache(self, slots: int, max_len: int) -> SlotKVCache: ...

    def cache_bytes(self, slots: int, max_len: int) -> int: ...  # what new_cache(slots, max_len) holds

    def prefill(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                starts: Optional[list[int]] = None) -> torch.Tensor: ...  # logits of each prompt's last token [n, V]

    # tokens [n] -> logits [n, V], and the rows' greedy picks where the step computed them (else None)
    def decode_picks(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        ...


@dataclass
class Run:
    """One stream's state: the pool, the live rows (slot i holds live[i]), the cache, the prompt being chunked (in
    the cache's last slot) and the finished rows' results not yet handed on."""

    pool: Pool
    sampler: Sampler
    on_result: Callable[[Result], None]
    live: list[Sequence] = field(default_factory=list)
    cache: Any = None
    chunked: Optional[Sequence] = None
    done: list[Result] = field(default_factory=list)

    def finish(self, seq: Sequence, reason: str) -> None:
        result = self.sampler.make_result(seq.request, seq.generated, reason, seq.draw)
        result.cached_prompt_tokens, result.latency_s = seq.start, time.monotonic() - seq.arrived
        self.done.append(result)

    def hand_on(self) -> None:
        """The finished rows' results to the job (which journals them, and commits a part when its last is in)."""
        while self.done:
            self.on_result(self.done.pop(0))


class Scheduler:
    def __init__(self, sampler: Sampler, stepper: Stepper, *, max_batch_tokens: int, max_batch_size: int,
                 prefixes: Optional[PrefixCache] = None, stats: Optional[SchedulerStats] = None,
                 governor: Optional[AbstractContextManager[Any]] = None):
        self.sampler = sampler  # picks tokens and decides finishing (sampling, EOS, stop strings)
        self.stepper = stepper  # prefill / decode on a SlotKVCache
        self.prefixes = prefixes  # shared prompt prefixes computed once (engine.prefix_cache); None: off
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.stats = stats if stats is not None else SchedulerStats()  # the engine's own: live in the status
        # entered around every prefill and decode call: on CPU, cpu/threads.py's governor, which times them
        self.governor = governor if governor is not None else nullcontext()

    def run(self, requests: list[Request], on_result: Optional[Callable[[Result], None]]) -> list[Result]:
        """One window: its Results in request order."""
        return generate_by_stream(self.stream, requests, on_result)

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        run = Run(Pool(source, self.sampler), self.sampler, on_result)
        while True:
            run.pool.top_up()
            if not run.pool.waiting and not run.live and run.chunked is None:
                if run.done:  # the job may open its next parts once these are committed
                    run.hand_on()
                    continue
                if run.pool.exhausted:
                    return
                raise starved()
            if run.chunked is None:
                self._admit_waiting(run)
            if run.chunked is not None:
                self._chunk_step(run)
            if run.live:
                self._decode_step(run)
            else:
                run.hand_on()

    def _admit_waiting(self, run: Run) -> None:
        """Prefill waiting rows into the free slots (the cache grown first where needed), or start chunking a prompt
        past the token budget. A row that finishes on its first token frees its slot at once: admit again."""
        if run.pool.waiting and (run.cache is None or len(run.live) < run.cache.slots):
            run.cache = self._fit(run.cache, len(run.live), run.pool)
        while admitted := self._admit(run.pool.waiting, len(run.live), run.cache.slots):
            if self._too_long(admitted[0]):
                run.chunked = self._start_chunks(run.cache, admitted[0])
                return
            first = len(run.live)
            logits = self._prefill_groups(run.cache, first, admitted)
            run.live += admitted
            self._advance(logits, run.live[first:], first, run.cache, run.live, run.finish)

    def _chunk_step(self, run: Run) -> None:
        """The chunked prompt's next chunk; once it is all in, the row moves to the next live slot and decodes."""
        assert run.chunked is not None
        logits = self._next_chunk(run.cache, run.chunked)
        if logits is None:
            return
        if run.cache.slots - 1 != len(run.live):
            run.cache.move(run.cache.slots - 1, len(run.live))
        run.live.append(run.chunked)
        run.chunked = None
        self._advance(logits, run.live[-1:], len(run.live) - 1, run.cache, run.live, run.finish)

    def _decode_step(self, run: Run) -> None:
        """One decode step of every live row; the rows finished before it are handed on while it runs."""
        tokens = torch.tensor([s.generated[-1] for s in run.live], device=self.stepper.device)
        with self.governor:
            logits, picks = self.stepper.decode_picks(run.cache, tokens)
        run.hand_on()  # launched: on a GPU the step runs while the host does this
        self.stats.decode_steps += 1
        self.stats.decode_row_steps += len(run.live)
        self._advance(logits, list(run.live), 0, run.cache, run.live, run.finish, picks)

    def _fit(self, cache: Any, n_live: int, pool: Pool) -> Any:
        """The cache, grown where the pool needs more: slots up to max_batch_size (only as many as there are rows
        once the source is exhausted), positions to the longest request seen (in steps of LEN_STEP). Growing
        copies the live sequences into the new cache."""
        want_slots = self.max_batch_size if not pool.exhausted else min(self.max_batch_size,
                                                                          n_live + len(pool.waiting))
        want_len = -(-pool.max_len // LEN_STEP) * LEN_STEP
        # the KV budget (free device memory) caps the slots at the length the cache has or needs: a cache already
        # as large as the budget allows is kept, and rows wait for a free slot
        want_slots = self._within_budget(want_slots, max(want_len, cache.max_len if cache is not None else 0), n_live)
        if cache is not None and cache.slots >= want_slots and cache.max_len >= pool.max_len:
            return cache
        slots = max(want_slots, cache.slots if cache is not None else 1)
        if cache is not None and cache.max_len < want_len:  # grow by half at least: few reallocations per job
            want_len = max(want_len, -(-cache.max_len * 3 // 2 // LEN_STEP) * LEN_STEP)
        length = max(want_len, cache.max_len if cache is not None else 0)
        slots = self._within_budget(slots, length, n_live)  # the length may have grown by half
        if cache is not None and n_live == 0:
            cache = None  # nothing to carry over: free the old cache before allocating the new one
        grown = self._allocate(slots, length, n_live)
        if cache is not None:
            grown.copy_from(cache, n_live)
        return grown

    def _within_budget(self, slots: int, length: int, n_live: int) -> int:
        """`slots`, fewer where the stepper's KV budget (free device memory) holds fewer at `length` positions; never
        below the live rows (they are in the cache already) nor 1."""
        budget = self.stepper.kv_budget_bytes
        if budget is None:
            return slots
        fit = budget // max(self.stepper.cache_bytes(1, length), 1)
        return max(min(slots, fit), n_live, 1)

    def _allocate(self, slots: int, max_len: int, n_live: int) -> Any:
        """A KV cache; if it does not fit, halve the slots (engine.max_batch_size) until it does, never below the
        live sequences it must take over."""
        while True:
            try:
                cache = self.stepper.new_cache(slots, max_len)
                self.stats.kv_slots, self.stats.kv_positions = slots, max_len
                self.stats.kv_cache_bytes = self.stepper.cache_bytes(slots, max_len)
                log.info("KV cache: %d slots x %d positions, %.2f GB", slots, max_len, self.stats.kv_cache_bytes / 1e9)
                return cache
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if slots <= max(n_live, 1) or not is_oom(exc):
                    raise
                slots = self.max_batch_size = max(slots // 2, n_live, 1)
                self.stats.oom_backoffs += 1
                log.warning("out of memory allocating the KV cache; engine.max_batch_size lowered to %d", slots)

    def _admit(self, waiting: deque[Sequence], n_live: int, slots: int) -> list[Sequence]:
        """Next waiting requests for the free slots, as long as their prefill fits the token budget (padded to the
        longest, unless the stepper's prefill pads nothing); a prompt past the budget alone (it is chunked)."""
        admitted: list[Sequence] = []
        width = tokens = 0
        while waiting and n_live + len(admitted) < slots:
            length = len(waiting[0].request.prompt_ids)
            if self._too_long(waiting[0]):
                return admitted or [waiting.popleft()]
            width, tokens = max(width, length), tokens + length
            cost = tokens if self.stepper.packed_prefill else (len(admitted) + 1) * width
            if admitted and cost > self.max_batch_tokens:
                break
            admitted.append(waiting.popleft())
        return admitted

    def _too_long(self, seq: Sequence) -> bool:
        return len(seq.request.prompt_ids) > self.max_batch_tokens

    def _start_chunks(self, cache: Any, seq: Sequence) -> Sequence:
        """A prompt past the token budget takes the cache's last slot (no live row reaches it while it is prefilled:
        nothing else is admitted meanwhile), with its longest cached prefix where the prefix cache has one."""
        if self.prefixes is not None and (prefix := self.prefixes.lookup(seq.request.prompt_ids)) is not None:
            cache.load_prefix(cache.slots - 1, prefix.k, prefix.v)
            seq.start = len(prefix.ids)
            self.stats.prefix_tokens_reused += seq.start
        seq.filled = seq.start
        return seq

    def _next_chunk(self, cache: Any, seq: Sequence) -> Optional[torch.Tensor]:
        """Prefill the chunked prompt's next engine.max_batch_tokens tokens (halved on out-of-memory) in the cache's
        last slot, attending over the earlier ones; the logits of its last token once the prompt is all in."""
        prompt = seq.request.prompt_ids
        while True:
            end = min(len(prompt), seq.filled + self.max_batch_tokens)
            try:
                with self.governor:
                    logits = self.stepper.prefill(cache, cache.slots - 1, [prompt[:end]], [seq.filled])
                break
            except (torch.OutOfMemoryError, RuntimeError) as exc:
                if end - seq.filled == 1 or not is_oom(exc):
                    raise
                self.stats.oom_backoffs += 1
                self.max_batch_tokens = max(self.max_batch_tokens // 2, 1)
                log.warning("out of memory prefilling a chunk of %d tokens; engine.max_batch_tokens lowered to %d "
                            "and retrying", end - seq.filled, self.max_batch_tokens)
        self.stats.prefill_tokens += end - seq.filled
        self.stats.prefill_padded_tokens += end - seq.filled
        self.stats.prefill_chunks += 1
        seq.filled = end
        if end < len(prompt):
            return None
        self.stats.prefill_rows += 1
        return logits

    def _prefill_groups(self, cache: Any, first_slot: int, admitted: list[Sequence]) -> torch.Tensor:
        """Prefill admitted rows (longest first) in groups of similar length, so padding stays under ~25%; with the
        prefix cache, what is left of each prompt after its cached prefix is what is grouped and prefilled."""
        if self.prefixes is not None:
            self._reuse_prefixes(cache, first_slot, admitted)
        logits, start = [], 0
        while start < len(admitted):
            width = admitted[start].suffix
            end = len(admitted) if self.stepper.packed_prefill else start + 1
            while end < len(admitted) and admitted[end].suffix >= PAD_RATIO * width:
                end += 1
            logits.append(self._prefill(cache, first_slot + start, admitted[start:end]))
            start = end
        return torch.cat(logits)

    def _reuse_prefixes(self, cache: Any, first_slot: int, admitted: list[Sequence]) -> None:
        """Compute once each prefix two or more admitted rows share (slot `first_slot`, free until they are placed,
        serves as scratch), then give each row the longest cached prefix of its prompt: into its slot, and its
        prefill starts after it. Reorders `admitted` (their slots) longest remaining prompt first."""
        assert self.prefixes is not None
        per_token = cache.k[:, 0, :, 0].numel() * cache.k.element_size() * 2  # keys and values, every layer
        for ids in self.prefixes.shared([s.request.prompt_ids for s in admitted], per_token):
            with self.governor:
                self.stepper.prefill(cache, first_slot, [list(ids)])
            self.prefixes.add(ids, *cache.prefix_of(first_slot, len(ids)))
            self.stats.prefix_tokens_computed += len(ids)
            self.stats.prefill_tokens += len(ids)
            self.stats.prefix_cache_bytes = self.prefixes.stats.prefix_cache_bytes
        for seq in admitted:
            seq.prefix = self.prefixes.lookup(seq.request.prompt_ids)
            seq.start = len(seq.prefix.ids) if seq.prefix is not None else 0
        admitted.sort(key=lambda s: -s.suffix)
        for j, seq in enumerate(admitted):
            if seq.prefix is not None:
                cache.load_prefix(first_slot + j, seq.prefix.k, seq.prefix.v)
                self.stats.prefix_tokens_reused += seq.start
                seq.prefix = None

    def _prefill(self, cache: Any, first_slot: int, admitted: list[Sequence]) -> torch.Tensor:
        """Prefill a bucket; on out-of-memory halve the token budget and prefill it in halves."""
        def run(start: int, stop: int) -> torch.Tensor:
            rows = admitted[start:stop]
            prompts = [s.request.prompt_ids for s in rows]
            starts = [s.start for s in rows]
            slot = first_slot + start
            with self.governor:
                logits = (self.stepper.prefill(cache, slot, prompts, starts) if any(starts)
                          else self.stepper.prefill(cache, slot, prompts))
            suffixes = [s.suffix for s in rows]
            self.stats.prefill_rows += len(rows)
            self.stats.prefill_tokens += sum(suffixes)
            self.stats.prefill_padded_tokens += (sum(suffixes) if self.stepper.packed_prefill
                                                 else len(rows) * max(suffixes))
            return logits

        def on_oom(rows: int) -> None:
            self.stats.oom_backoffs += 1
            self.max_batch_tokens = max(self.max_batch_tokens // 2, 1)
            log.warning("out of memory prefilling %d rows; engine.max_batch_tokens lowered to %d and retrying",
                        rows, self.max_batch_tokens)

        return torch.cat(halve_on_oom(len(admitted), run, on_oom))

    def _advance(self, logits: torch.Tensor, stepped: list[Sequence], first_slot: int, cache: Any,
                 live: list[Sequence], finish: Callable[[Sequence, str], None],
                 picks: Optional[torch.Tensor] = None) -> None:
        """Append each stepped sequence's next token; retire the finished ones, compacting the slots."""
        tokens = self.sampler.pick(logits, [s.request for s in stepped], [s.draw for s in stepped], picks)
        done: list[int] = []
        for j, (seq, token) in enumerate(zip(stepped, tokens)):
            seq.generated.append(token)
            reason = self.sampler.finish_reason(seq.request.params, seq.generated, seq.draw)
            if reason is not None:
                finish(seq, reason)
                done.append(first_slot + j)
        for slot in sorted(done, reverse=True):  # fill each hole with the last live sequence
            last = len(live) - 1
            if slot != last:
                cache.move(last, slot)
                live[slot] = live[last]
            live.pop()
