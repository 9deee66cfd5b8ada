"""Shared prompt prefixes computed once: the hf engine's prefix cache (`engine.prefix_cache`).

Prompts are cut into blocks of BLOCK tokens. When rows are admitted together, every block-aligned prefix that
two or more of them share and the cache does not hold yet is prefilled once (the longest such prefix per row), its
keys and values kept here; each row then takes the longest prefix the cache holds into its slot and prefills only
the rest, at positions starting after it. A row always prefills at least its last token (its logits start the
generation). The samples of a row (sampling.n > 1) share their whole prompt this way.

Matching is on token ids, so a prefix is reused only where the row's own tokenization starts with exactly those
ids: where BPE merged across the end of a shared system prompt, the row shares a shorter prefix (or none) and
prefills the rest itself. Entries are kept by least recent use within `engine.prefix_cache_mb`; a hit compares the
stored ids with the row's, so a hash collision can never reuse the wrong keys. Knows token ids and tensors, not
models or requests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

BLOCK = 32  # tokens per block: prefixes are reused in whole blocks
# engine.prefix_cache=auto reuses a prefix from this many tokens on. Measured on the benchmark model (bf16, Zen 4 EPYC,
# 64 rows of ~50 tokens of their own after a shared prefix, 8 new tokens each; time with the cache over without):
# 0.74 with 32 shared tokens, 0.54 with 64, 0.41 with 128. One block already pays, so auto starts there too.
AUTO_MIN_TOKENS = BLOCK


@dataclass
class Entry:
    ids: tuple[int, ...]  # the prefix's token ids
    k: torch.Tensor  # [layers, kv_heads, P, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass(slots=True)
class PrefixStats:  # the reuse counters are the scheduler's (SchedulerStats)
    prefix_cache_bytes: int = 0  # held now
    prefix_evictions: int = 0


def for_config(mode: str, max_mb: int) -> Optional[PrefixCache]:
    """engine.prefix_cache: auto reuses prefixes of AUTO_MIN_TOKENS or more (today one block, as `on` does), on any
    whole block, off none."""
    if mode == "off":
        return None
    return PrefixCache(max_mb << 20, AUTO_MIN_TOKENS if mode == "auto" else BLOCK)


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int):
        self.max_bytes = max_bytes
        self.min_blocks = max(1, -(-min_tokens // BLOCK))
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # hash of the prefix ids -> entry, oldest use first
        self.stats = PrefixStats()

    def lookup(self, ids: list[int]) -> Optional[Entry]:
        """The longest cached prefix of `ids` that leaves at least its last token to prefill."""
        for blocks in range((len(ids) - 1) // BLOCK, self.min_blocks - 1, -1):
            key = tuple(ids[:blocks * BLOCK])
            entry = self.entries.get(hash(key))
            if entry is not None and entry.ids == key:
                self.entries.move_to_end(hash(key))
                return entry
        return None

    def shared(self, prompts: list[list[int]], bytes_per_token: int = 0) -> list[tuple[int, ...]]:
        """Block-aligned prefixes worth computing once for these prompts: per prompt, the longest that another prompt
        of the group shares and the cache does not already hold beyond, and that fits the cache's byte bound
        (`bytes_per_token` of keys and values); each listed once."""
        counts: dict[tuple[int, ...], int] = {}
        most = (self.max_bytes // bytes_per_token) // BLOCK if bytes_per_token else None  # blocks that fit
        for ids in prompts:
            top = (len(ids) - 1) // BLOCK if most is None else min((len(ids) - 1) // BLOCK, most)
            for blocks in range(self.min_blocks, top + 1):
                key = tuple(ids[:blocks * BLOCK])
                counts[key] = counts.get(key, 0) + 1
        wanted: list[tuple[int, ...]] = []
        for ids in prompts:
            cached = self.lookup(ids)
            best = None
            top = (len(ids) - 1) // BLOCK if most is None else min((len(ids) - 1) // BLOCK, most)
            for blocks in range(top, self.min_blocks - 1, -1):
                key = tuple(ids[:blocks * BLOCK])
                if cached is not None and len(key) <= len(cached.ids):
                    break
                if counts.get(key, 0) >= 2:
                    best = key
                    break
            if best is not None and best not in wanted:
                wanted.append(best)
        return wanted

    def add(self, ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        entry = Entry(ids, k.clone(), v.clone())
        if entry.nbytes > self.max_bytes:
            return
        replaced = self.entries.pop(hash(ids), None)  # the same ids again, or a hash collision: one entry per hash
        if replaced is not None:
            self.stats.prefix_cache_bytes -= replaced.nbytes
        self.entries[hash(ids)] = entry
        self.stats.prefix_cache_bytes += entry.nbytes
        while self.stats.prefix_cache_bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.stats.prefix_cache_bytes -= old.nbytes
            self.stats.prefix_evictions += 1
