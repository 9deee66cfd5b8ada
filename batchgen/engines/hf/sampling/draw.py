"""The one sampling draw of the hf engine, on every device: a seeded row picks the same tokens on CPU and on CUDA,
alone or in any batch, slot or thread count, and after a resume that replays its steps.

Every row is greedy (the first index of its largest logit) or sampled: temperature, top-k, top-p, min-p, then
Gumbel-max, argmax(logits + g), where g's uniforms come from a counter-based hash of (seed, step, token index).
There is no generator state: a row's noise is a function of its seed and its step only. No op here reads a value on
the host or has a value-dependent shape (tests/engines/hf/backends/cuda/syncguard.py checks it), so a CUDA step can
run it. Everything is plain torch, so it runs, and is tested, on CPU tensors. A platform may do two steps with its
own kernels where they give the same values (DrawOps): greedy rows' first index of the largest value, the
filter's stable descending sort (one permutation, whichever algorithm finds it), and the integer hash's signed
halves (exact integer work; the logarithms stay torch's).

The penalties, logit_bias and min_tokens are not applied here: the Sampler applies them to the logits it passes
in (processors.py), once, before this draw and before a greedy row's argmax, so they hold for every row.

Knows tensors and SampleParams; nothing about models, caches, requests or devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from batchgen.sampling import SampleParams

VERSION = "counter-hash"  # the draw, as the manifest records it (batchgen.sampling.SEEDED_DRAW)
MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive token indices over the lanes before the first mix
KEY_STARTS = (0x243F6A88, 0x85A308D3)  # digits of pi: the two key lanes' starting values
HALF = 1 << 31
# A sampled draw over at most this many values ([n, V]) runs on one of torch's threads: its ops are short passes
# (a log over 32,000 values: 45 us on one AVX2 EPYC core) that a second thread's wake-up outlasts (8 ms on a busy
# 2-core machine). The values are the same on any thread count.
ONE_THREAD_VALUES = 1 << 20


def first_largest(logits: torch.Tensor) -> torch.Tensor:
    """[n] int64: each row's first index of its largest value (NaN counts as largest). max's indices, not argmax:
    the same answer, 4.2x faster on [64, 151936] float32 logits at 2 threads (Sapphire Rapids)."""
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class DrawOps:
    """What a platform may do its own way without changing a token (backends/: Backend.draw_ops)."""

    argmax: Callable[[torch.Tensor], torch.Tensor] = first_largest  # greedy rows' pick: logits [n, V] -> [n] int64
    # the signed halves of (key1 [n], key2 [n], V) from row_keys: [n, V] float32, halves_of_keys' values
    halves: Optional[Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = None
    # x [n, V] float32 -> (values, indices [n, V] int64): torch.sort(x, -1, descending=True, stable=True)'s
    sort: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None


TORCH_OPS = DrawOps()  # plain torch: any device


@dataclass(slots=True)
class RowParams:
    """The sampling parameters of the rows drawn together, one tensor a parameter, row i at index i; built once a
    step from the rows' SampleParams (one host-to-device copy a parameter, not one a row)."""

    temperature: torch.Tensor  # [n] float32; 1 for greedy rows: unused, keeps the division finite
    top_k: torch.Tensor  # [n] int64; 0 = off
    top_p: torch.Tensor  # [n] float32; 1 = off
    min_p: torch.Tensor  # [n] float32; 0 = off
    seed: torch.Tensor  # [n] int64: the row's 64-bit seed, as a two's-complement int64
    greedy: torch.Tensor  # [n] bool
    sampled: bool  # on the host: any row samples
    filtered: bool  # on the host: any sampled row uses top-k, top-p or min-p

    @classmethod
    def of_rows(cls, params: list[SampleParams], seeds: list[Optional[int]], device: torch.device) -> RowParams:
        greedy = [p.greedy for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        filtered = any(not g and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p, g in zip(params, greedy))
        return cls(temperature=tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
                   top_k=tensor([p.top_k for p in params], torch.int64),
                   top_p=tensor([p.top_p for p in params], torch.float32),
                   min_p=tensor([float(p.min_p) for p in params], torch.float32),
                   seed=tensor([as_int64(s or 0) for s in seeds], torch.int64),
                   greedy=tensor(greedy, torch.bool), sampled=not all(greedy), filtered=filtered)


def as_int64(value: int) -> int:
    """The low 64 bits of `value` as a signed int64 (what a seed tensor holds)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def pick(logits: torch.Tensor, params: RowParams, steps: torch.Tensor, ops: DrawOps = TORCH_OPS) -> torch.Tensor:
    """Next token of each row: [n] int64. logits: [n, V]; steps: [n] int64, each row's index of the token being
    drawn (tokens it generated so far), which with its seed fixes its noise. A greedy row takes ops.argmax's."""
    greedy_tokens = ops.argmax(logits)  # the first index of the largest value, ties included
    if not params.sampled:
        return greedy_tokens
    return torch.where(params.greedy, greedy_tokens, sample(logits, params, steps, ops))


def sample(logits: torch.Tensor, params: RowParams, steps: torch.Tensor, ops: DrawOps = TORCH_OPS) -> torch.Tensor:
    """Each row's draw, greedy or not: [n] int64 (logits [n, V], steps [n]). Temperature, then the filters where a
    row has one (params.filtered: else no sort), then argmax(x + g). On one thread up to ONE_THREAD_VALUES."""
    with one_thread_up_to(logits.numel()):
        return draw_rows(logits, params, steps, ops)


def draw_rows(logits: torch.Tensor, params: RowParams, steps: torch.Tensor, ops: DrawOps) -> torch.Tensor:
    """sample's work, on the threads it was given."""
    x = logits.float() / params.temperature[:, None]
    if params.filtered:
        x = filter_logits(x, params.top_k, params.top_p, params.min_p, sort=ops.sort)
    key1, key2 = row_keys(params.seed, steps)
    signed = (ops.halves or halves_of_keys)(key1, key2, x.shape[-1])
    return x.add_(gumbel_of_halves(signed)).argmax(dim=-1)


@contextlib.contextmanager
def one_thread_up_to(values: int) -> Iterator[None]:
    """torch on one thread for the block where it works on at most ONE_THREAD_VALUES values, then as it was."""
    before = torch.get_num_threads()
    if values > ONE_THREAD_VALUES or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, *,
                  sort: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None) -> torch.Tensor:
    """x [n, V] with the tokens each row's top-k, then top-p, then min-p drop set to -inf; one sort serves all three.

    top-k keeps every token at least as large as the k-th largest (ties at the k-th value all stay, as in the CPU
    sampler and vLLM); 0 or k >= V keeps all. top-p keeps the smallest prefix of the sorted, top-k-renormalised
    distribution whose mass reaches top_p (a token stays while the mass before it is at most top_p; tokens of
    equal value enter in index order); 1 keeps all. min-p drops tokens whose probability is below min_p times the
    largest; 0 keeps all, 1 keeps the largest (and its ties). The largest token always stays. sort: DrawOps.sort."""
    n, vocab = x.shape
    sorted_x, order = sort(x) if sort is not None else torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    drop = sorted_x < kth
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens ahead of each
    drop |= (before > top_p[:, None]) & (top_p < 1.0)[:, None]  # top_p=1 exactly off, whatever cumsum's rounding
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    keep = torch.empty_like(drop).scatter_(1, order, ~drop)
    return x.masked_fill(~keep, float("-inf"))


def gumbel(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [n, V] float32, -log(-log(u)) with u from hash_bits(seed, step, token index).

    u = (x + 1/2) / 2^32 for the 32-bit hash x: strictly inside (0, 1) at full resolution. Float32 cannot hold u
    near 1, so the lower half uses -log(u) and the upper half -log1p(-(1 - u)), each from the smaller of u and
    1 - u, which float32 holds to 24 significant bits; -log(u) is then finite and positive. In-place ops where the
    values are the same as out of place (a CPU's time goes to allocating [n, V] tensors otherwise)."""
    return gumbel_of_halves(halves_of_keys(*row_keys(seed, step), vocab))


def halves_of_keys(key1: torch.Tensor, key2: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, V] float32: min(u, 1 - u) for each token's u (hash_bits of the row's keys), negative where u >= 1/2."""
    x = hash_of_keys(key1, key2, vocab)
    low = x < HALF
    small = torch.where(low, x, x ^ MASK32).float().add_(0.5).mul_(2.0 ** -32)  # min(u, 1 - u), in (0, 1/2]
    return torch.where(low, small, small.neg())


def gumbel_of_halves(signed: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from halves_of_keys' values (consumed)."""
    low = signed > 0
    small = signed.abs_()
    expo = torch.where(low, torch.log(small).neg_(), small.neg_().log1p_().neg_())  # -log(u): exponential(1)
    return expo.log_().neg_()


def hash_bits(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """32 random bits per (row, token index): [n, V] int64 in [0, 2^32), a function of (seed, step, index) only.

    Each row's 64-bit key is mixed from its seed and step ([n] work); each token's bits are two mixing rounds of
    its index with the key's two lanes ([n, V] work)."""
    return hash_of_keys(*row_keys(seed, step), vocab)


def hash_of_keys(key1: torch.Tensor, key2: torch.Tensor, vocab: int) -> torch.Tensor:
    """hash_bits from the rows' keys (row_keys)."""
    index = torch.arange(vocab, dtype=torch.int64, device=key1.device).mul_(GOLDEN).bitwise_and_(MASK32)
    h = mix32(index[None, :] ^ key1[:, None])
    h ^= key2[:, None]
    return mix32(h)


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row, each absorbing the 32-bit lanes of seed and step in turn from its own start."""
    words = (seed & MASK32, (seed >> 32) & MASK32, step & MASK32, (step >> 32) & MASK32)
    keys = []
    for start in KEY_STARTS:
        h = torch.full_like(seed, start)
        for word in words:
            h = mix32(h ^ word)
        keys.append(h)
    return keys[0], keys[1]


def mix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser, in place, on int64 tensors holding values in [0, 2^32): a bijection with full
    avalanche.

    A product of two 32-bit values can pass 2^63 and wrap in int64; its low 32 bits, all that & MASK32 keeps, are
    the same either way, so the result is exact on every device."""
    h ^= h >> 16
    h.mul_(0x85EBCA6B).bitwise_and_(MASK32)
    h ^= h >> 13
    h.mul_(0xC2B2AE35).bitwise_and_(MASK32)
    h ^= h >> 16
    return h


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picked [n], top values [n, k], top indices [n, k]): the log-probabilities of the raw logits (log-softmax
    before temperature and filters, as vLLM's raw logprobs) of each row's token and of its k likeliest, on the
    device, fixed shapes. logits: [n, V]; tokens: [n] int64."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, tokens[:, None])[:, 0]
    top = torch.topk(logp, k, dim=-1)
    return picked, top.values, top.indices
