"""A KV cache allocated once: `slots` sequences of up to `max_len` tokens, for every layer.

Live sequences always occupy slots [0, n): when one finishes, the last live sequence moves into its
slot, so a decode step reads the cache through views, never through a gather, a concat or a
reallocation. Knows tensors, not models or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotKVCache:
    def __init__(self, *, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, max_len, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # valid tokens per slot
        self.host_lengths = [0] * slots  # the same, on the host: planning a step needs no device sync
        self.slots = slots
        self.max_len = max_len

    def write_prefill(self, layer: int, first_slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, T, head_dim] for slots [first_slot, first_slot + n), positions [0, T)."""
        n, _, t, _ = k.shape
        self.k[layer, first_slot:first_slot + n, :, :t] = k
        self.v[layer, first_slot:first_slot + n, :, :t] = v

    def write_after(self, layer: int, first_slot: int, starts: list[int], k: torch.Tensor, v: torch.Tensor,
                    counts: list[int]) -> None:
        """k, v: [n, kv_heads, T, head_dim]; row i's first counts[i] positions go to slot first_slot + i at
        positions [starts[i], starts[i] + counts[i]) (a prefill after a reused prefix)."""
        for i, (start, count) in enumerate(zip(starts, counts)):
            self.k[layer, first_slot + i, :, start:start + count] = k[i, :, :count]
            self.v[layer, first_slot + i, :, start:start + count] = v[i, :, :count]

    def load_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A cached prefix's keys and values, [layers, kv_heads, P, head_dim], into positions [0, P) of `slot`."""
        p = k.shape[2]
        self.k[:, slot, :, :p] = k
        self.v[:, slot, :, :p] = v

    def prefix_of(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of `slot`, every layer: views, [layers, kv_heads, length, head_dim]."""
        return self.k[:, slot, :, :length], self.v[:, slot, :, :length]

    def set_lengths(self, first_slot: int, lengths: list[int]) -> None:
        self.lengths[first_slot:first_slot + len(lengths)] = torch.tensor(lengths, device=self.lengths.device)
        self.host_lengths[first_slot:first_slot + len(lengths)] = lengths

    def advance(self, n: int) -> None:
        """Slots [0, n) each hold one more token."""
        self.lengths[:n] += 1
        for slot in range(n):
            self.host_lengths[slot] += 1

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, 1, head_dim] for slots [0, n), each at its own position lengths[slot]."""
        n = k.shape[0]
        rows = torch.arange(n, device=k.device)
        positions = self.lengths[:n]
        self.k[layer, rows, :, positions] = k[:, :, 0]
        self.v[layer, rows, :, positions] = v[:, :, 0]

    def view(self, layer: int, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, n), positions [0, length): views, [n, kv_heads, length, head_dim]."""
        return self.k[layer, :n, :, :length], self.v[layer, :n, :, :length]

    def view_row(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one slot, positions [0, length): views, [1, kv_heads, length, head_dim]."""
        return (self.k[layer, slot:slot + 1, :, :length], self.v[layer, slot:slot + 1, :, :length])

    def copy_from(self, other: SlotKVCache, n: int) -> None:
        """Take over sequences [0, n) of `other` (a smaller cache being grown into this one), valid positions only."""
        if n:
            length = max(other.host_lengths[:n])
            self.k[:, :n, :, :length] = other.k[:, :n, :, :length]
            self.v[:, :n, :, :length] = other.v[:, :n, :, :length]
        self.lengths[:n] = other.lengths[:n]
        self.host_lengths[:n] = other.host_lengths[:n]

    def move(self, src: int, dst: int) -> None:
        """Copy sequence `src` into slot `dst` (all layers, valid positions only)."""
        length = self.host_lengths[src]
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.lengths[dst] = self.lengths[src]
        self.host_lengths[dst] = length


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one decode step reads the cache: every row over the first `width` positions (shorter rows
    masked), and each of `long_rows` (row, length) again over its own length.

    One long prompt among short ones would otherwise make every row read (and mask) the longest row's
    length: on the benchmark workload that was 2.5x the valid positions. Rows whose length exceeds the
    common width pay a separate, unpadded attention call instead.
    """

    width: int
    long_rows: tuple[tuple[int, int], ...]

    # Cost of a separate call, in cache positions of the batched call: an estimate from micro-benchmarks of
    # per-row against batched decode attention (a per-row call's fixed cost, ~20 us, over the batched call's
    # time per row and position); the end-to-end gain was measured with it, other values were not tried.
    ROW_CALL_COST = 64
    MAX_LONG_ROWS = 16

    @classmethod
    def for_lengths(cls, lengths: list[int]) -> AttentionPlan:
        """Pick the width minimising n * width + sum over long rows of (length + ROW_CALL_COST)."""
        n = len(lengths)
        order = sorted(range(n), key=lambda r: -lengths[r])
        best_k, best_cost, split = 0, n * lengths[order[0]], 0
        for k in range(1, min(cls.MAX_LONG_ROWS, n - 1) + 1):
            split += lengths[order[k - 1]] + cls.ROW_CALL_COST
            cost = n * lengths[order[k]] + split
            if cost < best_cost:
                best_k, best_cost = k, cost
        width = lengths[order[best_k]]
        return cls(width, tuple((r, lengths[r]) for r in order[:best_k]))
