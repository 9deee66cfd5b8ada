"""The hf engine's path for any architecture: length-sorted static buckets through the model's own
forward and a transformers DynamicCache. A row leaves the batch the step it finishes; a bucket that
runs out of memory is generated in halves under a halved token budget. The Llama family takes the
continuous-batching path instead (scheduler.py over step.py); this one serves the rest, and windows
longer than that path's cache allows. Knows a model's forward and the Sampler, not slots or kernels.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from batchgen.engines.hf.oom import halve_on_oom
from batchgen.engines.hf.sampling.sampler import Sampler
from batchgen.engines.hf.scheduler import SchedulerStats
from batchgen.records import Request, Result

log = logging.getLogger(__name__)


class GenericGenerator:
    def __init__(self, model: Any, sampler: Sampler, *, pad_id: int, max_batch_tokens: int, max_batch_size: int,
                 stats: SchedulerStats):
        self.model = model
        self.sampler = sampler
        self.device = sampler.device
        self.pad_id = pad_id
        self.max_batch_tokens = max_batch_tokens  # lowered on out-of-memory, kept for the next window
        self.max_batch_size = max_batch_size
        self.stats = stats
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x

    def run(self, requests: list[Request], on_result: Optional[Callable[[Result], None]]) -> list[Result]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
        results: list[Optional[Result]] = [None] * len(requests)
        for bucket in self._buckets(order, requests):
            for i, result in zip(bucket, self._bucket_or_halve([requests[i] for i in bucket])):
                results[i] = result
                if on_result is not None:
                    on_result(result)
        return results  # type: ignore[return-value]

    def _buckets(self, order: list[int], requests: list[Request]) -> list[list[int]]:
        buckets: list[list[int]] = []
        current: list[int] = []
        for i in order:
            width = max(len(requests[current[0]].prompt_ids) if current else 0, len(requests[i].prompt_ids))
            if current and ((len(current) + 1) * width > self.max_batch_tokens or len(current) >= self.max_batch_size):
                buckets.append(current)
                current = []
            current.append(i)
        if current:
            buckets.append(current)
        return buckets

    def _bucket_or_halve(self, reqs: list[Request]) -> list[Result]:
        """On out-of-memory, halve the budget and generate the bucket in halves (logged, counted)."""
        def on_oom(rows: int) -> None:
            self.stats.oom_backoffs += 1
            self.max_batch_tokens = max(self.max_batch_tokens // 2, 1)
            log.warning("out of memory generating %d rows; engine.max_batch_tokens lowered to %d and retrying",
                        rows, self.max_batch_tokens)

        parts = halve_on_oom(len(reqs), lambda start, stop: self._bucket(reqs[start:stop]), on_oom)
        return [result for part in parts for result in part]

    def _bucket(self, reqs: list[Request]) -> list[Result]:
        """Prefill the bucket left-padded, then decode; a row leaves the batch the step it finishes."""
        from transformers import DynamicCache

        ids, mask, positions = left_pad([r.prompt_ids for r in reqs], self.pad_id, self.device)  # [B, T] each
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)  # [B, V]
        draws = [self.sampler.start(r) for r in reqs]
        generated: list[list[int]] = [[] for _ in reqs]
        reasons: list[Optional[str]] = [None] * len(reqs)
        active = list(range(len(reqs)))  # rows of `reqs` still in the batch
        next_pos = positions[:, -1] + 1  # [B]
        while True:
            tokens = self.sampler.pick(logits, [reqs[a] for a in active], [draws[a] for a in active])
            keep = []
            for j, a in enumerate(active):
                generated[a].append(tokens[j])
                reasons[a] = self.sampler.finish_reason(reqs[a].params, generated[a], draws[a])
                if reasons[a] is None:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                active = [active[j] for j in keep]
                tokens = [tokens[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            step_ids = torch.tensor(tokens, device=self.device)[:, None]
            logits = self._forward(step_ids, mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
            self.stats.decode_steps += 1
            self.stats.decode_row_steps += len(active)
        return [self.sampler.make_result(r, g, reason, d) for r, g, reason, d in zip(reqs, generated, reasons, draws)]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :]


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids left-padded to the longest, with their attention mask and position ids (from 0 at each sequence's
    first real token): [B, T] each, on `device`."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[b, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)
