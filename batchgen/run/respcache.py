"""Never generating the same request twice: within a job, identical requests are generated once and the answer is
handed to every row that asked (run.dedupe); across runs, answers are kept in run.cache_dir (local or fsspec),
keyed by a content hash, so tonight's job reuses last night's even where the ids changed.

A request's key is a SHA-256 over what decides its answer: the model (its identity: weights digest, or the served
model an endpoint reports), the engine settings that change outputs (output_config's engine keys, the resolved
dtype and quantization), the prompt as sent (token ids, and chat messages for an endpoint's chat), the sampling
settings and the seed. Only greedy samples and seeded ones are reused (batchgen seeds every sampled request, from
the job seed, the row id and the sample index, or from the row's own seed column); beam search rows are not.
An error answer (an endpoint's rejection) is handed to the duplicates of this job but never stored. A cache entry
carries its key and a digest of its body: one that does not read back whole is a miss (logged), never an answer.

`CachedEngine` wraps any engine's `stream`; the runner and the Ray workers wrap theirs alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Callable
from typing import Any, Optional

from batchgen.engines.base import Engine, EngineStats, ResponseCacheCounts, Source, generate_by_stream
from batchgen.records import Request, Result
from batchgen.sampling import DECODING, PROCESSORS

log = logging.getLogger(__name__)
STORED = ("text", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "choice_scores", "token_logprobs",
          "top_logprobs", "reasoning", "cached_prompt_tokens", "reasoning_tokens", "loglik", "embedding")
FORMAT = 2  # in every key: an entry written without a field of STORED is never read as an answer


def namespace(parts: dict[str, Any]) -> str:
    """The model and engine half of every key."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def request_key(space: str, req: Request) -> Optional[str]:
    """The content key of a request whose answer may be reused; None where it may not (beam search)."""
    if req.params.num_beams > 1:
        return None
    params = dataclasses.asdict(req.params)
    for key, default in (PROCESSORS | DECODING).items():  # keys added later: at their defaults, the key they had
        if params.get(key) in (default, {}, None):
            params.pop(key, None)
    if not params.get("answers"):  # task=decide's row answer set, added later: absent elsewhere, the key they had
        params.pop("answers", None)
    body = {"prompt": req.prompt_ids, "messages": req.messages, "seed": req.seed, "params": params}
    return hashlib.sha256((space + json.dumps(body, sort_keys=True, default=str)).encode()).hexdigest()


class ResponseStore:
    """run.cache_dir: one small JSON file per answer under <key[:2]>/<key>.json, written whole (a temp name, then
    renamed, on a local disk; one put on object storage)."""

    def __init__(self, url: str):
        import fsspec

        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.corrupt = 0

    def _path(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key[:2]}/{key}.json"

    def get(self, key: str) -> Optional[dict[str, Any]]:
        path = self._path(key)
        try:
            with self.fs.open(path, "rb") as f:
                entry = json.loads(f.read())
            body = entry["result"]
            if entry["key"] != key or entry["digest"] != _digest(body):
                raise ValueError("its key or digest does not match its body")
            return checked({k: body[k] for k in STORED})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # torn, edited, foreign: a miss
            self.corrupt += 1
            log.warning("run.cache_dir: %s is unreadable (%s: %s); generating the request again", path,
                        type(exc).__name__, exc)
            return None

    def put(self, key: str, result: Result) -> None:
        body = {k: getattr(result, k) for k in STORED}
        data = json.dumps({"key": key, "digest": _digest(body), "result": body}).encode()
        path = self._path(key)
        try:
            if self.local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except OSError as exc:  # a full disk or a lost bucket costs the cache, never the job
            log.warning("run.cache_dir: could not write %s (%s); the answer is not cached", path, exc)


INT32_MAX = 2**31 - 1


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT32_MAX


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) or v == -math.inf  # a logprob may be -inf, never NaN


def _numbers(v: Any) -> bool:
    return isinstance(v, list) and all(_number(x) for x in v)


def _top(v: Any) -> bool:  # per token: [[token_id, token, logprob], ...]
    return isinstance(v, list) and all(isinstance(t, list) and all(
        isinstance(c, list) and len(c) == 3 and _count(c[0]) and isinstance(c[1], str) and _number(c[2])
        for c in t) for t in v)


FIELDS: dict[str, Callable[[Any], bool]] = {
    "text": lambda v: isinstance(v, str), "finish_reason": lambda v: v in ("stop", "length", "scored"),
    "num_prompt_tokens": _count, "num_generated_tokens": _count,
    "choice_scores": _numbers, "token_logprobs": _numbers, "top_logprobs": _top,
    "reasoning": lambda v: isinstance(v, str), "cached_prompt_tokens": _count, "reasoning_tokens": _count,
    "loglik": lambda v: _numbers(v) and len(v) == 2, "embedding": _numbers,
}
OPTIONAL = frozenset(STORED) - {"text", "finish_reason", "num_prompt_tokens", "num_generated_tokens"}


def checked(body: dict[str, Any]) -> dict[str, Any]:
    """A stored answer's fields, each of its type and range (a count a non-negative int32, a score a finite number,
    a finish reason stop, length or scored), or ValueError naming the first that is not: a foreign writer of a shared
    run.cache_dir (its digest is a checksum, not a signature) costs a miss, never the job."""
    for name, ok in FIELDS.items():
        value = body[name]
        if not (value is None and name in OPTIONAL) and not ok(value):
            raise ValueError(f"its {name} is {str(value)[:80]!r}, not what an answer holds")
    return body


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class CacheStats:
    """CachedEngine's counters as they run (stats() hands them on as base.ResponseCacheCounts)."""

    hits: int = 0  # answers read from run.cache_dir
    deduplicated: int = 0  # requests answered by an identical one of this job
    stored: int = 0  # answers written to run.cache_dir


class CachedEngine:
    """An engine whose `stream` generates each distinct request once (run.dedupe) and reads and writes run.cache_dir;
    the rest of the Engine protocol is the wrapped engine's."""

    def __init__(self, engine: Engine, space: str, store: Optional[ResponseStore], dedupe: bool):
        self.engine, self.space, self.store, self.dedupe = engine, space, store, dedupe
        self.cache_stats = CacheStats()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_batch_size(self) -> Optional[int]:  # the wrapped engine's, as it is now (an OOM backoff may lower it)
        return self.engine.max_batch_size

    def identity(self) -> dict[str, Any]:
        return self.engine.identity()

    def close(self) -> None:
        self.engine.close()

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(),
                                   response_cache=ResponseCacheCounts(**dataclasses.asdict(self.cache_stats)))

    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        return generate_by_stream(self.stream, requests, on_result)

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        leaders: dict[str, int] = {}  # content key -> the engine key of the request generating it
        keys: dict[int, str] = {}  # engine key of a leader -> its content key
        followers: dict[int, list[int]] = {}  # engine key of a leader -> the keys of its duplicates
        hits: list[Result] = []

        def flush() -> None:
            while hits:
                on_result(hits.pop(0))

        def wrapped_source() -> Optional[list[Request]]:
            while True:
                flush()
                batch = source()
                if not batch:
                    return batch
                todo = [r for r in batch if self._route(r, leaders, keys, followers, hits)]
                if todo or not hits:
                    return todo

        def wrapped_result(result: Result) -> None:
            content = keys.pop(result.key, None)
            if content is not None:
                leaders.pop(content, None)
                if self.store is not None and result.error is None:
                    self.store.put(content, result)
                    self.cache_stats.stored += 1
            on_result(result)
            for key in followers.pop(result.key, ()):
                on_result(dataclasses.replace(result, key=key, answered="deduplicated"))

        stream = self.engine.stream
        stream(wrapped_source, wrapped_result)
        flush()

    def _route(self, req: Request, leaders: dict[str, int], keys: dict[int, str], followers: dict[int, list[int]],
               hits: list[Result]) -> bool:
        """True where the engine must generate `req`; else its answer is queued in `hits` (from run.cache_dir) or
        will follow its leader's."""
        content = request_key(self.space, req) if (self.dedupe or self.store is not None) else None
        if content is None:
            return True
        if self.dedupe and content in leaders:
            followers.setdefault(leaders[content], []).append(req.key)
            self.cache_stats.deduplicated += 1
            return False
        stored = self.store.get(content) if self.store is not None else None
        if stored is not None:
            hits.append(Result(key=req.key, latency_s=0.0, answered="cache", **stored))
            self.cache_stats.hits += 1
            return False
        leaders[content] = req.key
        keys[req.key] = content
        return True


def wrap(engine: Engine, cfg: Any, model: dict[str, Any]) -> Engine:
    """The engine behind run.dedupe and run.cache_dir (itself where both are off). `model`: the manifest's model
    identity (model_identity)."""
    if not cfg.run.dedupe and not cfg.run.cache_dir:
        return engine
    from batchgen.output.manifest import ENDPOINT_KEYS, ENGINE_KEYS, output_config

    identity = engine.identity()
    space = namespace({"format": FORMAT, "model": model, "engine": output_config(cfg)["engine"], "task": cfg.task,
                       "resolved": {k: identity.get(k) for k in (*ENGINE_KEYS, *ENDPOINT_KEYS)}})
    store = ResponseStore(cfg.run.cache_dir) if cfg.run.cache_dir else None
    return CachedEngine(engine, space, store, cfg.run.dedupe)
