"""Engine contract: Requests in, one Result per Request out.

Two ways in. `generate(window)` returns the window's Results in request order. `stream(source, on_result)`
is how a job runs: the engine asks `source()` for more requests whenever it has room, so rows of the next
parts join the batch while the current part's last rows finish (the engine never drains at a part's end),
and hands each Result to `on_result` the moment it is final, in completion order. Request keys are unique
among the requests in flight. An engine owns batching, length bucketing, the KV cache, quantization and
device placement. It knows nothing about files, parts, ids or Hydra.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Protocol

from batchgen.errors import BatchgenError
from batchgen.records import Request, Result
from batchgen.sampling import SampleParams, find_stop, split_reasoning

DTYPES = ("auto", "bfloat16", "float16", "float32")
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # name or org/name: left to from_pretrained (a hub, if reachable)
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".gguf")


def model_dir_problems(path: str, key: str, weights: bool = True) -> list[str]:
    """What makes `path` unusable as a local model (or tokenizer) directory, checked before anything loads."""
    if os.path.isdir(path):
        names = os.listdir(path)
        if weights and "config.json" not in names:
            return [f"{key}: {path} has no config.json; point it at a model directory (save_pretrained's output)"]
        if weights and not any(n.endswith(WEIGHT_FILES) for n in names):
            return [f"{key}: {path} has no weight files (*.safetensors, *.bin); point it at a model directory "
                    f"with its weights"]
        return []
    if os.path.exists(path):
        return [f"{key}: {path} is a file; point it at a model directory"]
    if HUB_ID.match(path) and not path.startswith((".", "/")):
        return []
    return [f"{key}: no such model directory: {path}"]


@dataclass
class EngineConfig:
    """The keys every engine reads. Each engine's own config class extends it beside the engine (hf/config.py,
    vllm.py, dummy.py) and the registry (engines/__init__.py) names it; `engine=NAME` picks it in Hydra."""

    MODEL_HAS_WEIGHTS: ClassVar[bool] = True  # engine.model must hold weights (dummy: a tokenizer will do)

    name: str = "hf"  # hf | vllm | openai | dummy (chosen with `engine=hf`, `engine=vllm`, ...)
    model: str = "???"  # local model directory (or hub id where the hub is reachable)
    tokenizer: Optional[str] = None  # tokenizer directory; null = the model's
    dtype: str = "auto"  # auto = the fastest exact-enough dtype for the device
    quantization: Optional[str] = None  # weight quantization scheme, per engine
    max_batch_tokens: Optional[int] = None  # token budget of one forward pass; null = engine default
    max_batch_size: Optional[int] = None  # rows decoded together at most; null = engine default
    max_model_len: Optional[int] = None  # prompt + generation limit; null = the model's own
    trust_remote_code: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.model in ("???", "", None):
            out.append("engine.model is required (a local model directory)")
        else:
            out += model_dir_problems(self.model, "engine.model", weights=self.MODEL_HAS_WEIGHTS)
        if self.tokenizer:
            out += model_dir_problems(self.tokenizer, "engine.tokenizer", weights=False)
        if self.dtype not in DTYPES:
            out.append(f"engine.dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        return out + at_least_one(self, "max_batch_tokens", "max_batch_size", "max_model_len")


def at_least_one(cfg: Any, *keys: str) -> list[str]:
    """engine.KEY >= 1 or null, for each of `keys`."""
    return [f"engine.{key} must be >= 1 or null (got {getattr(cfg, key)})" for key in keys
            if getattr(cfg, key) is not None and getattr(cfg, key) < 1]


# The engine's supply of work: a non-empty list of new requests; [] when there are none right now (the caller's
# look-ahead is full: ask again once results have come back); None when there will be no more.
Source = Callable[[], Optional[list[Request]]]


@dataclass(frozen=True)
class ResponseCacheCounts:
    """What run.dedupe and run.cache_dir did (run/respcache.py's wrapper counts them)."""

    hits: int = 0  # answers read from run.cache_dir
    deduplicated: int = 0  # requests answered by an identical one of this job
    stored: int = 0  # answers written to run.cache_dir


@dataclass(frozen=True)
class EngineStats:
    """What an engine reports of its work so far (Engine.stats()): its own counters, shown as they are in
    _status.json's "engine", and the few figures the run's summary names."""

    counters: dict[str, Any] = field(default_factory=dict)  # e.g. decode_steps, oom_backoffs (hf), steps (vllm)
    prefix_tokens_reused: int = 0  # prompt tokens taken from a prefix cache instead of prefilled
    kv_slots: int = 0  # the KV cache as last allocated: rows decoded together at most (0: the engine keeps none)
    kv_positions: int = 0  # positions per slot
    kv_cache_bytes: int = 0  # its keys and values, every layer
    response_cache: Optional[ResponseCacheCounts] = None  # run.dedupe / run.cache_dir (None: both off)

    def since(self, start: EngineStats) -> EngineStats:
        """What the engine did after `start` (its stats when a run began; a batchgen.Session's engine serves many
        runs): each counter less its value then, a level (LEVEL_COUNTERS, the kv_* fields: what it holds now) as
        it is now, the response cache's counts as they are (each run wraps the engine in its own)."""
        counters = {k: v if k in LEVEL_COUNTERS or not _count(v) or not _count(start.counters.get(k))
                    else v - start.counters[k] for k, v in self.counters.items()}
        return dataclasses.replace(self, counters=counters,
                                   prefix_tokens_reused=self.prefix_tokens_reused - start.prefix_tokens_reused)


LEVEL_COUNTERS = frozenset({"kv_slots", "kv_positions", "kv_cache_bytes", "prefix_cache_bytes"})  # counters that
# say what an engine holds now (hf's KV cache and prefix cache), not a sum of its work: EngineStats.since keeps them


def _count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Engine(Protocol):
    max_model_len: int  # prompt + generation limit in tokens
    max_batch_size: Optional[int]  # rows decoded together at most (sizes the job's look-ahead); None: not said

    def identity(self) -> dict[str, Any]:
        """What identifies the model and numerics: goes into the manifest and part metadata."""

    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        """One Result per Request, in the same order. `on_result` is called with each Result as soon as it is
        final (in completion order), so that the caller can journal finished work before the window ends."""

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        """Generate every request `source` gives, asking it for more whenever there is room, until it has
        returned None and every request is finished; each Result goes to `on_result` as soon as it is final."""

    def stats(self) -> EngineStats:
        """Its counters so far (read while it runs, for the status, and once at the end, for the summary)."""

    def close(self) -> None: ...


def take(source: Source) -> tuple[list[Request], bool]:
    """Everything `source` gives now, and whether it is exhausted (then never ask it again)."""
    new: list[Request] = []
    while (batch := source()) is not None:
        if not batch:
            return new, False
        new += batch
    return new, True


Generate = Callable[[list[Request], Optional[Callable[[Result], None]]], list[Result]]


def stream_windows(generate: Generate, source: Source, on_result: Callable[[Result], None]) -> None:
    """`stream` for an engine that runs one window at a time: each batch the source gives is one `generate`
    window (it drains at the window's end: the hf engine's generic path, engine=dummy, an older vLLM). The source
    returning [] with nothing in flight is the caller's error: it would wait forever."""
    while (batch := source()) is not None:
        if not batch:
            raise starved()
        generate(batch, on_result)


def starved() -> RuntimeError:
    """The error of a source that gives [] while the engine has nothing in flight: waiting would never end."""
    return RuntimeError("the request source has nothing to give while nothing is in flight")


def split_answer(tokenizer: Any, ids: list[int], params: SampleParams) -> tuple[list[int], Optional[str]]:
    """A thinking sample's (SampleParams.reasoning) generated ids as its answer's ids and its reasoning text (the
    start marker and surrounding whitespace dropped; all of it while the block never ended, the answer then empty);
    other samples' ids as they are, with no reasoning. The answer's leading whitespace after the marker is dropped."""
    r = params.reasoning
    if r is None:
        return ids, None
    k = split_reasoning(ids, r)
    thought = ids if k is None else ids[:k - len(r.end_ids)]
    text = tokenizer.decode(thought, skip_special_tokens=True).strip().removeprefix(r.start).strip()
    answer = [] if k is None else ids[k:]
    while answer and not tokenizer.decode(answer[:1], skip_special_tokens=True).strip():
        answer = answer[1:]  # whitespace tokens between the marker and the answer
    return answer, text


def answer_text(tokenizer: Any, ids: list[int], answer: list[int], params: SampleParams) -> str:
    """The answer's ids (split_answer's, of the generated `ids`) decoded in one piece (special tokens skipped and
    spaced as the sample says) and cut before the first stop string, or after it with include_stop_str_in_output, as
    every engine reports it; a stop string within the sample's first min_tokens tokens does not count (vLLM's
    min_tokens, which the hf engine follows)."""
    text = decode(tokenizer, answer, params)
    if not params.stop:
        return text
    head = params.min_tokens - (len(ids) - len(answer))  # the answer's tokens among the first min_tokens
    after = len(decode(tokenizer, answer[:head], params)) if head > 0 else 0
    cut = find_stop(text, params.stop, after)
    if cut >= 0 and params.include_stop_str_in_output:
        cut += next(len(s) for s in params.stop if text.startswith(s, cut))
    return text if cut < 0 else text[:cut]


def decode(tokenizer: Any, ids: list[int], params: SampleParams) -> str:
    """Generated ids as text, as vLLM's skip_special_tokens and spaces_between_special_tokens say (the latter only
    changes a slow tokenizer's decoding, as in vLLM, whose fast detokenizer ignores it too; passed only where it is
    off, so that a tokenizer whose decode does not know it serves every job that leaves it at its default)."""
    spacing = {} if params.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens, **spacing)


def reasoning_tokens(ids: list[int], answer: list[int], params: SampleParams) -> Optional[int]:
    """The generated tokens before a thinking sample's answer (its reasoning block, markers included); None for a
    sample that does not think."""
    return None if params.reasoning is None else len(ids) - len(answer)


CHARS_PER_TOKEN = 4  # without a tokenizer: a token is about 4 characters of English text (OpenAI's rule of thumb)


def estimate_tokens(text: str) -> int:
    """A text's token count estimated from its characters, where no tokenizer counts (engine=openai's chat endpoint
    without engine.tokenizer): prompt lengths before sending, and the counts of an answer that reports no usage. An
    estimate, never a limit: a token can be a single character."""
    return -(-len(text) // CHARS_PER_TOKEN)


def model_max_len(config: Any) -> int:
    """The model's own context length from its config (2048 where it says none)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def with_tokens(tokenizer: Any, top: list[list[list]]) -> list[list[list]]:
    """Top-logprob pairs [token_id, logprob] per position as triples [token_id, token text, logprob]: each token
    decoded alone (special tokens included), so that a reader sees " the", not an id."""
    ids = sorted({pair[0] for position in top for pair in position})
    texts = dict(zip(ids, tokenizer.batch_decode([[i] for i in ids]))) if ids else {}
    return [[[i, texts[i], lp] for i, lp in position] for position in top]


def generate_by_stream(stream: Callable[[Source, Callable[[Result], None]], None], requests: list[Request],
                       on_result: Optional[Callable[[Result], None]] = None) -> list[Result]:
    """`generate` written as one `stream` over the window: its Results in request order, each also passed to
    `on_result` as it is final. An engine that loses a request is an error, never a silent gap."""
    by_key: dict[int, Result] = {}
    given = [False]

    def source() -> Optional[list[Request]]:
        if given[0] or not requests:
            return None
        given[0] = True
        return list(requests)

    def collect(result: Result) -> None:
        by_key[result.key] = result
        if on_result is not None:
            on_result(result)

    stream(source, collect)
    missing = [r.key for r in requests if r.key not in by_key]
    if missing:
        raise BatchgenError(f"the engine returned no result for {len(missing)} requests (first key: {missing[0]})")
    return [by_key[r.key] for r in requests]
