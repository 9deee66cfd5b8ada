"""Token choice on the device, batched, with no host sync: what a decode step captured as a CUDA graph can run.

Every row is greedy (the first index of its largest logit) or sampled: temperature, top-k, top-p, min-p, then
Gumbel-max, argmax(logits + g), where g's uniforms come from a counter-based hash of (seed, step, token index).
There is no generator state, so a seeded row draws the same token alone or in any batch, in any slot, and after a
resume that replays its steps. Per-row parameters live in preallocated tensors (SlotParams), written on the host
when a row is admitted, outside the step. No op here reads a value on the host or has a value-dependent shape
(tests/engines/hf/backends/cuda/syncguard.py checks it), and everything is plain torch, so it runs, and is tested,
on CPU tensors.

The penalties, logit_bias and min_tokens are not applied here: the Sampler applies them to the logits it passes
in (engines/hf/sampling/processors.py), once, before this draw and before a greedy row's argmax, so they hold for
every row.

Knows tensors and SampleParams; nothing about models, caches or requests.
"""

from __future__ import annotations

from typing import Optional

import torch

from batchgen.sampling import SampleParams

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / phi: spreads consecutive token indices over the lanes before the first mix
KEY_STARTS = (0x243F6A88, 0x85A308D3)  # digits of pi: the two key lanes' starting values
HALF = 1 << 31


class SlotParams:
    """Sampling parameters of up to `slots` rows, one device tensor per parameter, row i in slot i.

    Live rows occupy slots [0, n), as in kvcache.SlotKVCache: when one finishes, the last live row moves into
    its slot (move). Host mirrors of which slots sample and which filter let the caller choose a step variant
    (mode) without reading the device.
    """

    def __init__(self, slots: int, device: torch.device):
        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((slots,), value, dtype=dtype, device=device)

        self.temperature = full(1.0, torch.float32)  # 1 for greedy rows: unused, keeps the division finite
        self.top_k = full(0, torch.int64)  # 0 = off
        self.top_p = full(1.0, torch.float32)  # 1 = off
        self.min_p = full(0.0, torch.float32)  # 0 = off
        self.seed = full(0, torch.int64)  # the row's 64-bit seed, as a two's-complement int64
        self.greedy = full(True, torch.bool)
        self.host_sampled = [False] * slots  # the same as ~greedy, on the host
        self.host_filtered = [False] * slots  # the row uses top-k, top-p or min-p
        self.slots = slots

    @classmethod
    def of_rows(cls, params: list[SampleParams], seeds: list[Optional[int]], device: torch.device) -> SlotParams:
        """The rows' parameters in slots [0, len(params)), each tensor built from a list at once (one host-to-device
        copy a parameter, not one a row): for a caller that samples a different set of rows each call."""
        rows = cls.__new__(cls)
        greedy = [p.greedy for p in params]
        min_p = [float(p.min_p) for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        rows.temperature = tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
        rows.top_k = tensor([p.top_k for p in params], torch.int64)
        rows.top_p = tensor([p.top_p for p in params], torch.float32)
        rows.min_p = tensor(min_p, torch.float32)
        rows.seed = tensor([as_int64(s or 0) for s in seeds], torch.int64)
        rows.greedy = tensor(greedy, torch.bool)
        rows.host_sampled = [not g for g in greedy]
        rows.host_filtered = [not g and (p.top_k > 0 or p.top_p < 1.0 or m > 0.0)
                              for p, g, m in zip(params, greedy, min_p)]
        rows.slots = len(params)
        return rows

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.greedy

    def set(self, slot: int, params: SampleParams, seed: Optional[int], min_p: Optional[float] = None) -> None:
        """Admit a row into `slot`. seed: the row's own (sampling.derive_seed), None for a greedy row. min_p: None
        takes params.min_p."""
        min_p = params.min_p if min_p is None else min_p
        greedy = params.greedy
        if not greedy and seed is None:
            raise ValueError("a sampled row needs a seed")
        self.temperature[slot] = 1.0 if greedy else params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.min_p[slot] = min_p
        self.seed[slot] = as_int64(seed or 0)
        self.greedy[slot] = greedy
        self.host_sampled[slot] = not greedy
        self.host_filtered[slot] = not greedy and (params.top_k > 0 or params.top_p < 1.0 or min_p > 0.0)

    def move(self, src: int, dst: int) -> None:
        """Row `src` takes slot `dst` (a finished row's): device-to-device copies, no sync."""
        for t in self.tensors():
            t[dst] = t[src]
        self.host_sampled[dst] = self.host_sampled[src]
        self.host_filtered[dst] = self.host_filtered[src]

    def mode(self, n: int) -> tuple[bool, bool]:
        """(any of slots [0, n) samples, any filters), from the host mirrors: pick's `sampled` and `filtered`.
        A captured step bakes them in, so a caller keys its graphs by them."""
        return any(self.host_sampled[:n]), any(self.host_filtered[:n])


def as_int64(value: int) -> int:
    """The low 64 bits of `value` as a signed int64 (what a seed tensor holds)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def pick(logits: torch.Tensor, params: SlotParams, n: int, steps: torch.Tensor, out: Optional[torch.Tensor] = None,
         *, sampled: bool = True, filtered: bool = True) -> torch.Tensor:
    """Next token of rows [0, n): [n] int64 (into `out` where given). logits: [n, V]; steps: [n] int64, each row's
    index of the token being drawn (tokens it generated so far), which with its seed fixes its noise.

    sampled=False: every row is taken as greedy; filtered=False: top-k, top-p and min-p are skipped (no sort).
    Both are for a caller that knows (SlotParams.mode) that no row needs them; the defaults are always right."""
    greedy_tokens = logits.argmax(dim=-1)  # the first index of the largest value, ties included
    if not sampled:
        return greedy_tokens if out is None else out.copy_(greedy_tokens)
    x = logits.float() / params.temperature[:n, None]
    if filtered:
        x = filter_logits(x, params.top_k[:n], params.top_p[:n], params.min_p[:n])
    drawn = (x + gumbel(params.seed[:n], steps, x.shape[-1])).argmax(dim=-1)
    if out is None:
        return torch.where(params.greedy[:n], greedy_tokens, drawn)
    return torch.where(params.greedy[:n], greedy_tokens, drawn, out=out)


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x [n, V] with the tokens each row's top-k, then top-p, then min-p drop set to -inf; one sort serves all three.

    top-k keeps every token at least as large as the k-th largest (ties at the k-th value all stay, as in the CPU
    sampler and vLLM); 0 or k >= V keeps all. top-p keeps the smallest prefix of the sorted, top-k-renormalised
    distribution whose mass reaches top_p (a token stays while the mass before it is at most top_p; tokens of
    equal value enter in index order); 1 keeps all. min-p drops tokens whose probability is below min_p times the
    largest; 0 keeps all, 1 keeps the largest (and its ties). The largest token always stays."""
    n, vocab = x.shape
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
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
    1 - u, which float32 holds to 24 significant bits; -log(u) is then finite and positive."""
    x = hash_bits(seed, step, vocab)
    low = x < HALF
    small = (torch.where(low, x, x ^ MASK32).float() + 0.5) * 2.0 ** -32  # min(u, 1 - u), in (0, 1/2]
    expo = torch.where(low, -torch.log(small), -torch.log1p(-small))  # -log(u): exponential(1)
    return -torch.log(expo)


def hash_bits(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """32 random bits per (row, token index): [n, V] int64 in [0, 2^32), a function of (seed, step, index) only.

    Each row's 64-bit key is mixed from its seed and step ([n] work); each token's bits are two mixing rounds of
    its index with the key's two lanes ([n, V] work)."""
    key1, key2 = row_keys(seed, step)
    index = torch.arange(vocab, dtype=torch.int64, device=seed.device)
    h = mix32(((index * GOLDEN) & MASK32)[None, :] ^ key1[:, None])
    return mix32(h ^ key2[:, None])


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
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32): a bijection with full avalanche.

    A product of two 32-bit values can pass 2^63 and wrap in int64; its low 32 bits, all that & MASK32 keeps, are
    the same either way, so the result is exact on every device."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picked [n], top values [n, k], top indices [n, k]): the log-probabilities of the raw logits (log-softmax
    before temperature and filters, as vLLM's raw logprobs) of each row's token and of its k likeliest, on the
    device, fixed shapes. logits: [n, V]; tokens: [n] int64."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, tokens[:, None])[:, 0]
    top = torch.topk(logp, k, dim=-1)
    return picked, top.values, top.indices
