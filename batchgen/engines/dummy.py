"""`engine=dummy`: a deterministic engine without a model, for pipeline tests, dry runs and scheduler drills.

Each generated token is a pure function of (prompt token ids, seed, position): a keyed BLAKE2 hash mapped onto the
tokenizer's ordinary (non-special) ids, so a resumed, sharded or re-batched run writes exactly what an
uninterrupted one does, the same way the real engines do by their seeds. It honours the engine contract
(base.Engine) as the real ones must: one Result per Request in request order, each passed to `on_result` as it
finishes, the per-row cap, EOS (the hash picks EOS with probability `eos_rate` per token unless ignore_eos),
stop strings cut before their match, finish reasons `stop` and `length`. `engine.extra_args.delay_s` sleeps that
long per generated token (kill-timing tests), `engine.extra_args.eos_rate` (default 0.05) sets how often
samples end early. No torch, no weights: `engine.model` names the tokenizer's directory.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from batchgen.engines.base import EngineConfig, EngineStats, Source, starved, take
from batchgen.records import Request, Result
from batchgen.sampling import find_stop


@dataclass
class DummyConfig(EngineConfig):
    """engine=dummy's settings: engine.model names a tokenizer directory (no weights read)."""

    MODEL_HAS_WEIGHTS: ClassVar[bool] = False

    name: str = "dummy"
    extra_args: dict[str, Any] = field(default_factory=dict)  # delay_s: seconds per token; eos_rate [0.05]


class DummyEngine:
    def __init__(self, cfg: DummyConfig, tokenizer: Any):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_model_len = cfg.max_model_len or 2048
        self.max_batch_size = cfg.max_batch_size  # every request is answered alone: no batch of its own
        self.delay_s = float(cfg.extra_args.get("delay_s", 0.0))
        self.eos_rate = float(cfg.extra_args.get("eos_rate", 0.05))
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.vocab = [i for i in range(len(tokenizer)) if i not in special]
        self.eos_id = tokenizer.eos_token_id

    def stats(self) -> EngineStats:
        return EngineStats()

    def identity(self) -> dict[str, Any]:
        return {"engine": "dummy", "dtype": None, "eos_rate": self.eos_rate}

    def close(self) -> None:
        pass

    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        results = []
        for request in requests:
            result = self._one(request)
            if on_result is not None:
                on_result(result)
            results.append(result)
        return results

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        """One request at a time, the queue topped up from `source` after each result, as a continuously batching
        engine does: the next parts' requests are taken while the current part's last ones run."""
        queue: deque[Request] = deque()
        exhausted = False
        while True:
            if not exhausted:
                new, exhausted = take(source)
                queue.extend(new)
            if not queue:
                if exhausted:
                    return
                raise starved()
            on_result(self._one(queue.popleft()))

    def _one(self, request: Request) -> Result:
        started = time.monotonic()
        result = self._generate(request)
        result.cached_prompt_tokens, result.latency_s = 0, time.monotonic() - started
        return result

    def _generate(self, request: Request) -> Result:
        key = hashlib.blake2b(repr((request.prompt_ids, request.seed)).encode(), digest_size=16).digest()
        params = request.params
        ids: list[int] = []
        reason = "length"
        for position in range(params.max_new_tokens):
            if self.delay_s:
                time.sleep(self.delay_s)
            draw = int.from_bytes(hashlib.blake2b(position.to_bytes(4, "little"), key=key, digest_size=8).digest(),
                                  "little")
            if self.eos_id is not None and not params.ignore_eos and (draw % 10_000) < self.eos_rate * 10_000:
                ids.append(self.eos_id)
                reason = "stop"
                break
            ids.append(self.vocab[draw % len(self.vocab)])
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = find_stop(text, params.stop) if params.stop else -1
        if cut >= 0:
            text, reason = text[:cut], "stop"
        return Result(key=request.key, text=text, finish_reason=reason, num_prompt_tokens=len(request.prompt_ids),
                      num_generated_tokens=len(ids))
