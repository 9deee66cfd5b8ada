"""Out-of-memory back-off shared by the hf engine's paths (the scheduler's prefill, the generic path): recognise an
out-of-memory error on any device, and run a batch in halves, recursively, until it fits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

R = TypeVar("R")


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
