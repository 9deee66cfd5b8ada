"""Typed records that flow between reader/planner, engine and committer (docs/contract.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from batchgen.sampling import SampleParams


@dataclass(slots=True)
class InputBatch:
    """A slice of input rows, in input order, as the reader streams them."""

    start: int  # index of the first row in the whole input order (0-based, across files)
    table: pa.Table  # the rows' input columns
    ids: list[str]  # one id per row (given or generated `<file>:<row>`)
    read_errors: list[str | None]  # per row: why it could not be read (malformed JSONL line), else None


@dataclass(slots=True)
class Part:
    """The unit of commit: input rows [index * rows_per_part, (index + 1) * rows_per_part)."""

    index: int  # part number k
    start: int  # first input row of the part
    table: pa.Table
    ids: list[str]
    read_errors: list[str | None]

    @property
    def num_rows(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class Request:
    """One sample to generate: what the engine receives."""

    key: int  # position of this sample in its part's output (row * n + sample_index)
    prompt_ids: list[int]  # token ids, after any truncation
    params: SampleParams
    seed: int | None  # per-sample seed; None for greedy
    messages: list[dict] | None = None  # chat messages, for an engine that renders them (engine=openai's chat)


@dataclass(slots=True)
class PlannedPart:
    """A part turned into engine requests (the planner's output), with what the committer needs to restore it."""

    part: Part
    requests: list[Request]  # one per sample of every generable row, key row * n + sample_index
    errors: list[str | None]  # per row: why it is an error row, else None
    seeds: list[int | None]  # per output row (row * n + sample_index), error rows' included; None for greedy
    n: int  # samples per row
    skipped: frozenset[int] = frozenset()  # rows already generated in run.skip_existing's output: no output rows
    counts: tuple[int, ...] | None = None  # per row, its samples where rows differ (dataset.n_column); None: n each
    # task=decide: per question (name, kind, its answers, abstain_below), in request key order
    questions: tuple[tuple[str, str, tuple[str, ...], float | None], ...] | None = None
    prompts: list[str | None] | None = None  # output.include_prompt: per row, its prompt as rendered (None: it erred)


@dataclass(slots=True)
class Result:
    """What the engine returns for one Request."""

    key: int
    text: str  # decoded generation, special tokens skipped, cut before a matched stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    num_prompt_tokens: int
    num_generated_tokens: int
    choice_scores: list[float] | None = None  # sampling.choice_scores: each choice's probability, in choice order
    token_logprobs: list[float] | None = None  # sampling.logprobs: each generated token's log-probability
    top_logprobs: list[list[list]] | None = None  # per generated token: the top k, [token_id, token, logprob]
    reasoning: str | None = None  # a thinking sample's reasoning (text is then its answer only)
    error: str | None = None  # the engine could not generate this sample (an endpoint rejected it): an error row
    cached_prompt_tokens: int | None = None  # prompt tokens the engine took from its prefix cache (None: unknown)
    reasoning_tokens: int | None = None  # generated tokens of a thinking sample's reasoning block (None: not thinking)
    latency_s: float | None = field(default=None, compare=False)  # from the engine taking the request to its result
    loglik: list[float] | None = None  # task=loglik: [total log-likelihood, scored tokens] of the scored span
    embedding: list[float] | None = None  # task=embed: the pooled final hidden state
    # not generated for this request: "deduplicated" (an identical request's answer, run.dedupe) or "cache"
    # (run.cache_dir); None: the engine generated (or scored) it. The run's throughput counts only the engine's work
    answered: str | None = field(default=None, compare=False)


@dataclass(slots=True)
class OutputRow:
    """One output row (one sample), as committed (docs/contract.md section 4)."""

    row: int  # row position within the part (to take passthrough columns)
    id: str
    sample_index: int
    generation: str | None
    finish_reason: str  # "stop", "length" or "error"
    num_prompt_tokens: int
    num_generated_tokens: int
    seed: int | None
    error: str | None  # an input error (generation null) or, for a constrained sample, `invalid_output: ...`
    parsed: str | None = None  # a constrained sample's validated value: a schema's JSON text, else the text itself
    choice_scores: list[tuple[str, float]] | None = None  # [(label, probability), ...] in choice order: a map column
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[dict]] | None = None  # per generated token: [{"token", "token_id", "logprob"}, ...]
    reasoning: str | None = None
    cached_prompt_tokens: int | None = None  # output.usage: as the engine's Result says
    reasoning_tokens: int | None = None
    latency_s: float | None = None
    cost: float | None = None  # output.prices: this sample's price (each sample's request carries its prompt)
    loglik: float | None = None  # task=loglik: the scored tokens' summed log-probability (natural log)
    loglik_mean: float | None = None  # per scored token
    perplexity: float | None = None  # exp(-loglik_mean)
    scored_tokens: int | None = None
    embedding: list[float] | None = None  # task=embed
    decisions: dict | None = None  # task=decide: question name -> {answer, confidence, probabilities, expected}
    needs_review: bool | None = None  # task=decide: a question's top answer below its abstain_below
    rendered_prompt: str | None = None  # output.include_prompt: the row's prompt as rendered, before run.too_long
