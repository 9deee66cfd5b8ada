"""The continuous-batching scheduler over a fake stepper whose next token is a known function of the row's
prompt and of how many tokens it has generated: results in request order, each row exactly its own tokens
up to its cap or its EOS, at most max_batch_size rows per step, free slots refilled at once, prefills under
the token budget, honest stats; and the out-of-memory back-offs (halve_on_oom, is_oom, the cache's slots)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Optional

import pytest
import torch

from batchgen.engines.hf.kvcache import SlotKVCache
from batchgen.engines.hf.oom import halve_on_oom, is_oom
from batchgen.engines.hf.sampling.sampler import Sampler
from batchgen.engines.hf.scheduler import PAD_RATIO, Scheduler
from batchgen.records import Request, Result
from batchgen.sampling import SampleParams

EOS = 1
FILL = 7  # prompt filler token; a prompt's first token names its row
VOCAB = 1000
CPU = torch.device("cpu")
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12"


def token(ident: int, g: int) -> int:
    """The planned g-th generated token of row `ident`: distinct, three digits, never EOS or FILL."""
    assert 0 <= g < 20 and 0 <= ident < 40
    return 100 + 20 * ident + g


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == EOS))


class FakeStepper:
    """Reads each slot's row and progress from the cache itself (so a wrong move or an overwritten slot shows
    as a wrong token) and records every prefill and decode call."""

    device = CPU
    packed_prefill = False

    def __init__(self, eos_at: Optional[dict[int, int]] = None, cache_oom_above: Optional[int] = None,
                 prefill_oom_above: Optional[int] = None, cache_error: Optional[Exception] = None,
                 kv_budget_bytes: Optional[int] = None):
        self.kv_budget_bytes = kv_budget_bytes  # the KV cache's bound; None: unbounded
        self.eos_at = eos_at or {}  # row ident -> the g at which it emits EOS instead of its planned token
        self.cache_oom_above, self.prefill_oom_above = cache_oom_above, prefill_oom_above
        self.cache_error = cache_error
        self.prompts: dict[int, list[int]] = {}
        self.cache_requests: list[int] = []  # slots asked of new_cache, in order
        self.prefills: list[tuple[int, list[int]]] = []  # (first_slot, prompt lengths) of each prefill that ran
        self.decode_rows: list[int] = []  # rows of each decode step
        self.finished_at_decode: list[tuple[int, int]] = []  # per decode step: rows finished when its rows were
        # admitted (before their prefill), and when it ran
        self.finished_at_admission: Optional[int] = None
        self.made: list[int] = []  # keys of the results made (a row finished), in order (CountingSampler)
        self.handed_at_decode: list[tuple[int, int]] = []  # per decode step: results made, and handed on, by then
        self.finished: list[Result] = []  # on_result appends here
        self.events: list[tuple[str, int, int]] = []  # ("prefill", first row's ident, rows) / ("decode", rows, rows)

    def next_token(self, ident: int, g: int) -> int:
        return EOS if self.eos_at.get(ident) == g else token(ident, g)

    def logits(self, ids: list[int]) -> torch.Tensor:
        out = torch.full((len(ids), VOCAB), float("-inf"))
        out[torch.arange(len(ids)), torch.tensor(ids)] = 0.0
        return out

    def cache_bytes(self, slots: int, max_len: int) -> int:
        return 2 * slots * max_len * 4  # one layer, one head of width 1, float32 keys and values

    def new_cache(self, slots: int, max_len: int) -> SlotKVCache:
        self.cache_requests.append(slots)
        if self.cache_error is not None:
            raise self.cache_error
        if self.cache_oom_above is not None and slots > self.cache_oom_above:
            raise RuntimeError(CPU_OOM)
        return SlotKVCache(layers=1, slots=slots, kv_heads=1, max_len=max_len, head_dim=1, dtype=torch.float32,
                           device=CPU)

    def prefill(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                starts: Optional[list[int]] = None) -> torch.Tensor:
        """Each prompt's tokens from starts[i] on (those before it must be in the slot already: a chunked prompt's
        earlier chunks) into slot first_slot + i."""
        if self.prefill_oom_above is not None and len(prompts) > self.prefill_oom_above:
            raise RuntimeError(CPU_OOM)
        assert first_slot + len(prompts) <= cache.slots
        starts = starts or [0] * len(prompts)
        for i, (p, start) in enumerate(zip(prompts, starts)):
            slot = first_slot + i
            assert start == 0 or cache.k[0, slot, 0, :start, 0].long().tolist() == p[:start], "earlier chunk lost"
            cache.k[0, slot, 0, start:len(p), 0] = cache.v[0, slot, 0, start:len(p), 0] = torch.tensor(
                p[start:], dtype=torch.float32)
            self.prompts[p[0]] = p
        cache.set_lengths(first_slot, [len(p) for p in prompts])
        self.prefills.append((first_slot, [len(p) - start for p, start in zip(prompts, starts)]))
        self.events.append(("prefill", prompts[0][0], len(prompts)))
        if self.finished_at_admission is None:
            self.finished_at_admission = len(self.made)
        return self.logits([self.next_token(p[0], 0) for p in prompts])

    def decode_picks(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.decode(cache, tokens), None

    def decode(self, cache: SlotKVCache, tokens: torch.Tensor) -> torch.Tensor:
        n = len(tokens)
        assert n <= cache.slots
        self.decode_rows.append(n)
        self.events.append(("decode", n, n))
        admitted_at = len(self.made) if self.finished_at_admission is None else self.finished_at_admission
        self.finished_at_decode.append((admitted_at, len(self.made)))
        self.handed_at_decode.append((len(self.made), len(self.finished)))
        self.finished_at_admission = None
        out = []
        for slot in range(n):
            held = cache.k[0, slot, 0, :cache.host_lengths[slot], 0].long().tolist()
            assert cache.lengths[slot].item() == cache.host_lengths[slot]
            ident = held[0]
            prompt = self.prompts[ident]
            g = len(held) - len(prompt) + 1  # tokens generated so far, the one fed now included
            assert held == prompt + [self.next_token(ident, i) for i in range(g - 1)], f"slot {slot} is corrupt"
            assert tokens[slot].item() == self.next_token(ident, g - 1), f"slot {slot} was fed another row's token"
            out.append(self.next_token(ident, g))
        cache.append(0, tokens.float().view(n, 1, 1, 1), tokens.float().view(n, 1, 1, 1))
        cache.advance(n)
        return self.logits(out)


def params(cap: int, stop: tuple[str, ...] = (), ignore_eos: bool = False, temperature: float = 0.0
           ) -> SampleParams:
    return SampleParams(max_new_tokens=cap, temperature=temperature, top_p=1.0, top_k=0, stop=stop,
                        ignore_eos=ignore_eos)


def request(ident: int, length: int, p: SampleParams) -> Request:
    return Request(key=500 + ident, prompt_ids=[ident] + [FILL] * (length - 1), params=p,
                   seed=None if p.greedy else 1000 + ident)


def expected(req: Request, generated: list[int], reason: str) -> Result:
    return Result(key=req.key, text=FakeTokenizer().decode(generated), finish_reason=reason,
                  num_prompt_tokens=len(req.prompt_ids), num_generated_tokens=len(generated), cached_prompt_tokens=0)


class CountingSampler(Sampler):
    """The real sampler, telling the stepper when a row finishes (its result is made) as opposed to when the result
    is handed on."""

    def __init__(self, stepper: FakeStepper):
        super().__init__(FakeTokenizer(), {EOS}, CPU)
        self.stepper = stepper

    def make_result(self, request, *args, **kwargs):
        self.stepper.made.append(request.key)
        return super().make_result(request, *args, **kwargs)


def run(requests: list[Request], stepper: FakeStepper, *, max_batch_tokens: int = 10_000, max_batch_size: int = 4
        ) -> tuple[Scheduler, list[Result]]:
    scheduler = Scheduler(CountingSampler(stepper), stepper, max_batch_tokens=max_batch_tokens,
                          max_batch_size=max_batch_size)
    return scheduler, scheduler.run(requests, stepper.finished.append)


def mixed_requests(n: int = 11, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [request(i, rng.randint(1, 30), params(rng.randint(1, 12), temperature=0.0 if i % 3 else 0.8))
            for i in range(n)]


def check_stats(scheduler: Scheduler, stepper: FakeStepper, results: list[Result]) -> None:
    stats = scheduler.stats
    assert stats.decode_steps == len(stepper.decode_rows)
    assert stats.decode_row_steps == sum(stepper.decode_rows)
    # each row's first token comes from its prefill, every other one from one decode row: no row wasted
    assert stats.decode_row_steps == sum(r.num_generated_tokens - 1 for r in results)
    assert stats.prefill_rows == len(results)
    assert stats.prefill_rows + stats.prefill_chunks - chunked_rows(stepper) == sum(
        len(lengths) for _, lengths in stepper.prefills)
    assert stats.prefill_tokens == sum(sum(lengths) for _, lengths in stepper.prefills)
    assert stats.prefill_tokens == sum(r.num_prompt_tokens for r in results)
    assert stats.prefill_padded_tokens == sum(len(lengths) * max(lengths) for _, lengths in stepper.prefills)


def chunked_rows(stepper: FakeStepper) -> int:
    """Rows prefilled in chunks, over several passes (their last chunk counts as their prefill row)."""
    passes = Counter(ident for event, ident, _ in stepper.events if event == "prefill")
    return sum(1 for count in passes.values() if count > 1)


@pytest.mark.parametrize("order", ["random", "ascending", "descending"])
def test_results_come_back_in_request_order_each_with_exactly_its_own_tokens(order):
    requests = mixed_requests()
    if order != "random":
        requests.sort(key=lambda r: len(r.prompt_ids), reverse=order == "descending")
    stepper = FakeStepper()
    scheduler, results = run(requests, stepper, max_batch_size=4)
    assert results == [expected(r, [token(r.prompt_ids[0], g) for g in range(r.params.max_new_tokens)], "length")
                       for r in requests]
    assert sorted(r.key for r in stepper.finished) == sorted(r.key for r in requests)  # once per request
    assert all(r is f for r, f in zip(sorted(results, key=lambda r: r.key),
                                      sorted(stepper.finished, key=lambda r: r.key)))
    check_stats(scheduler, stepper, results)


def test_no_step_holds_more_than_max_batch_size_rows_and_free_slots_are_refilled_at_once():
    requests = mixed_requests(13, seed=1)
    stepper = FakeStepper()
    scheduler, results = run(requests, stepper, max_batch_size=3)
    assert stepper.cache_requests == [3]
    assert max(stepper.decode_rows) <= 3
    # with the token budget out of the way, every free slot is refilled before the next step, also the slots of
    # rows that finished on their prefill token (their cap is 1): a step holds every unfinished row it can
    assert stepper.decode_rows == [min(3, len(requests) - done) for _, done in stepper.finished_at_decode]
    assert any(done > admitted for admitted, done in stepper.finished_at_decode)  # the case is exercised
    assert scheduler.stats.decode_steps < sum(r.num_generated_tokens - 1 for r in results)
    check_stats(scheduler, stepper, results)


def test_longest_prompts_are_prefilled_first():
    requests = mixed_requests(9, seed=2)
    stepper = FakeStepper()
    run(requests, stepper, max_batch_size=3)
    admitted = [length for _, lengths in stepper.prefills for length in lengths]
    assert admitted == sorted((len(r.prompt_ids) for r in requests), reverse=True)


@pytest.mark.parametrize("budget", [1, 24, 40, 64])
def test_no_prefill_pass_goes_past_the_token_budget_a_longer_prompt_is_chunked(budget):
    rng = random.Random(budget)
    requests = [request(i, rng.randint(2, 30), params(rng.randint(1, 6))) for i in range(16)]
    requests.append(request(16, 50, params(3)))  # longer than some budgets on its own
    stepper = FakeStepper()
    scheduler, results = run(requests, stepper, max_batch_tokens=budget, max_batch_size=8)
    assert all(len(lengths) * max(lengths) <= budget for _, lengths in stepper.prefills)
    assert all(min(lengths) >= PAD_RATIO * max(lengths) for _, lengths in stepper.prefills)
    assert scheduler.stats.prefill_chunks == sum(-(-len(r.prompt_ids) // budget) for r in requests
                                                 if len(r.prompt_ids) > budget)
    if budget == 1:
        assert all(len(lengths) == 1 for _, lengths in stepper.prefills)
    assert [r.key for r in results] == [r.key for r in requests]
    assert [r.num_generated_tokens for r in results] == [r.params.max_new_tokens for r in requests]
    check_stats(scheduler, stepper, results)


def test_a_long_prompts_chunks_let_the_live_rows_decode_in_between():
    """A 100-token prompt arriving while three rows decode, under a 16-token budget: 7 chunks in the cache's last
    slot, a decode step of the live rows between each two (one of them finishing meanwhile), then the row moves to
    the next live slot and decodes, its tokens its own (the stepper reads every slot's history back from the
    cache, the chunks' included)."""
    first, late = [request(0, 4, params(19)), request(1, 5, params(19)), request(3, 3, params(4))], \
        request(2, 100, params(5))
    batches = [first, [], [late]]  # the long prompt arrives on the second top-up
    stepper = FakeStepper()
    scheduler = Scheduler(CountingSampler(stepper), stepper, max_batch_tokens=16, max_batch_size=4)
    scheduler.stream(lambda: batches.pop(0) if batches else None, stepper.finished.append)
    assert sorted(stepper.finished, key=lambda r: r.key) == [
        expected(r, [token(r.prompt_ids[0], g) for g in range(r.params.max_new_tokens)], "length")
        for r in sorted([*first, late], key=lambda r: r.key)]
    chunks = [i for i, (event, ident, _) in enumerate(stepper.events) if event == "prefill" and ident == 2]
    assert len(chunks) == 7 == scheduler.stats.prefill_chunks
    assert all(stepper.events[i + 1][0] == "decode" for i in chunks[:-1])  # the live rows were not stalled
    assert [slot for slot, lengths in stepper.prefills if lengths in ([16], [4])] == [3] * 7
    # row 3 finished while the chunks ran; the long row then moved from slot 3 to 2 and decodes with rows 0 and 1
    assert stepper.decode_rows[len(chunks) - 1:len(chunks) + 1] == [2, 3]
    check_stats(scheduler, stepper, stepper.finished)


def test_finished_rows_are_handed_on_after_the_next_step_is_launched():
    """The results of rows finished before decode step k reach the job after step k is launched and before step
    k + 1: on a GPU the host journals them while the step runs. None is lost, none is handed on twice."""
    requests = mixed_requests(13, seed=4)
    stepper = FakeStepper()
    _, results = run(requests, stepper, max_batch_size=3)
    made, handed = zip(*stepper.handed_at_decode)
    assert list(handed[1:]) == list(made[:-1])
    assert any(m > h for m, h in stepper.handed_at_decode)  # some results waited for a step
    assert sorted(r.key for r in stepper.finished) == sorted(stepper.made) == sorted(r.key for r in requests)


def test_a_row_stops_at_its_eos_unless_it_ignores_eos():
    requests = [request(0, 5, params(8)), request(1, 9, params(8)), request(2, 3, params(8, ignore_eos=True)),
                request(3, 6, params(4)), request(4, 4, params(6))]
    stepper = FakeStepper(eos_at={0: 0, 1: 3, 2: 2, 3: 3})  # row 3 hits EOS at its cap, row 4 never
    scheduler, results = run(requests, stepper, max_batch_size=2)
    assert results == [
        expected(requests[0], [EOS], "stop"),
        expected(requests[1], [token(1, 0), token(1, 1), token(1, 2), EOS], "stop"),
        expected(requests[2], [token(2, 0), token(2, 1), EOS] + [token(2, g) for g in range(3, 8)], "length"),
        expected(requests[3], [token(3, 0), token(3, 1), token(3, 2), EOS], "stop"),
        expected(requests[4], [token(4, g) for g in range(6)], "length"),
    ]
    assert results[2].text == " ".join(str(token(2, g)) for g in (0, 1, 3, 4, 5, 6, 7))
    check_stats(scheduler, stepper, results)


def test_a_row_stops_at_its_stop_string_and_the_text_is_cut_before_it():
    stop = str(token(1, 2))
    requests = [request(0, 4, params(6, stop=(stop,))), request(1, 4, params(6, stop=(stop,))),
                request(2, 4, params(3))]
    stepper = FakeStepper()
    _, results = run(requests, stepper, max_batch_size=3)
    assert results[0] == expected(requests[0], [token(0, g) for g in range(6)], "length")
    assert results[1] == Result(key=requests[1].key, text=f"{token(1, 0)} {token(1, 1)} ", finish_reason="stop",
                                num_prompt_tokens=4, num_generated_tokens=3, cached_prompt_tokens=0)
    assert results[2] == expected(requests[2], [token(2, g) for g in range(3)], "length")


def test_a_single_request_and_no_callback():
    stepper = FakeStepper()
    scheduler = Scheduler(Sampler(FakeTokenizer(), {EOS}, CPU), stepper, max_batch_tokens=8, max_batch_size=16)
    req = request(3, 20, params(5))
    assert scheduler.run([req], None) == [expected(req, [token(3, g) for g in range(5)], "length")]
    assert stepper.cache_requests == [1] and stepper.decode_rows == [1] * 4


@pytest.mark.parametrize(("fits", "asked"), [(3, [6, 3]), (2, [6, 3, 1])])
def test_a_cache_out_of_memory_halves_max_batch_size_and_every_result_still_comes(fits, asked):
    requests = mixed_requests(6, seed=3)
    stepper = FakeStepper(cache_oom_above=fits)
    scheduler, results = run(requests, stepper, max_batch_size=8)
    assert stepper.cache_requests == asked
    assert scheduler.max_batch_size == asked[-1] and scheduler.stats.oom_backoffs == len(asked) - 1
    assert max(stepper.decode_rows) <= asked[-1]
    assert results == [expected(r, [token(r.prompt_ids[0], g) for g in range(r.params.max_new_tokens)], "length")
                       for r in requests]


def test_the_kv_budget_bounds_the_slots_and_every_result_still_comes():
    """A stepper whose KV cache may hold 3 slots of 64 positions (engine.gpu_memory_utilization on CUDA): the
    scheduler asks 8 slots of no cache, decodes at most 3 rows a step, and says what it took in its stats."""
    requests = mixed_requests(9, seed=4)
    stepper = FakeStepper(kv_budget_bytes=3 * 2 * 64 * 4 + 100)
    scheduler, results = run(requests, stepper, max_batch_size=8)
    assert stepper.cache_requests == [3] and max(stepper.decode_rows) == 3
    assert (scheduler.stats.kv_slots, scheduler.stats.kv_positions) == (3, 64)
    assert scheduler.stats.kv_cache_bytes == stepper.cache_bytes(3, 64) <= stepper.kv_budget_bytes
    assert results == [expected(r, [token(r.prompt_ids[0], g) for g in range(r.params.max_new_tokens)], "length")
                       for r in requests]


def test_a_cache_error_that_is_not_out_of_memory_propagates_and_one_slot_out_of_memory_too():
    with pytest.raises(RuntimeError, match="device-side assert"):
        run(mixed_requests(4), FakeStepper(cache_error=RuntimeError("device-side assert triggered")))
    stepper = FakeStepper(cache_oom_above=0)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        run(mixed_requests(4), stepper, max_batch_size=4)
    assert stepper.cache_requests == [4, 2, 1]


def test_a_prefill_out_of_memory_halves_the_token_budget_and_prefills_in_halves():
    requests = [request(i, 10, params(3)) for i in range(8)]
    stepper = FakeStepper(prefill_oom_above=2)
    scheduler, results = run(requests, stepper, max_batch_tokens=1000, max_batch_size=8)
    assert [len(lengths) for _, lengths in stepper.prefills] == [2, 2, 2, 2]
    assert [first for first, _ in stepper.prefills] == [0, 2, 4, 6]
    assert scheduler.stats.oom_backoffs == 3 and scheduler.max_batch_tokens == 1000 // 8
    assert results == [expected(r, [token(i, g) for g in range(3)], "length") for i, r in enumerate(requests)]
    check_stats(scheduler, stepper, results)


def test_halve_on_oom_splits_recursively_and_keeps_the_outputs_in_order():
    calls, ooms = [], []

    def run_items(start: int, stop: int) -> tuple[int, int]:
        calls.append((start, stop))
        if stop - start > 3:
            raise RuntimeError(CPU_OOM)
        return start, stop

    assert halve_on_oom(10, run_items, ooms.append) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert ooms == [10, 5, 5]
    assert calls == [(0, 10), (0, 5), (0, 2), (2, 5), (5, 10), (5, 7), (7, 10)]
    calls.clear()
    assert halve_on_oom(3, run_items, ooms.append, start=4) == [(4, 7)] and calls == [(4, 7)]


def test_halve_on_oom_does_not_retry_other_errors_nor_a_single_item():
    ooms: list[int] = []

    def fail(exc: Exception):
        def run_items(start: int, stop: int):
            raise exc
        return run_items

    with pytest.raises(RuntimeError, match="shape mismatch"):
        halve_on_oom(8, fail(RuntimeError("shape mismatch")), ooms.append)
    with pytest.raises(ValueError):
        halve_on_oom(8, fail(ValueError(CPU_OOM)), ooms.append)
    assert ooms == []
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        halve_on_oom(1, fail(RuntimeError(CPU_OOM)), ooms.append)
    assert ooms == []
    with pytest.raises(torch.OutOfMemoryError):
        halve_on_oom(2, fail(torch.OutOfMemoryError("CUDA out of memory")), ooms.append)
    assert ooms == [2]  # tried both halves, each a single item that still did not fit


def test_is_oom_recognizes_the_cuda_error_and_the_cpu_allocator_message_only():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(torch.OutOfMemoryError())
    assert is_oom(RuntimeError(CPU_OOM))
    assert not is_oom(RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"))
    assert not is_oom(RuntimeError(""))
    assert not is_oom(KeyError("memory"))
