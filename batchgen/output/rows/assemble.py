"""A part's results made into its output rows: input order, the samples of a row consecutive, error rows for rows
that never reached the engine, constrained outputs checked, scores laid out as columns, and each sample's price
(output.prices). Whichever engine or run made a result, its row reads the same. Knows records, not files."""

from __future__ import annotations

import math
from typing import Any, Optional

from batchgen.constraints import Constraint, check
from batchgen.errors import BatchgenError
from batchgen.output.rows import decide
from batchgen.records import OutputRow, PlannedPart, Result


def assemble(planned: PlannedPart, results: list[Result]) -> list[OutputRow]:
    """A part's output rows in input order, the samples of a row consecutive, from the engine's results in any
    order (journaled ones from an earlier run included); an error row gets one row per sample. Every seed is the
    planner's (planned.seeds), so a row reads the same whichever run generated it. A constrained sample's text is
    checked here, whichever engine made it (constraints.check): `parsed` when it validates, else `invalid_output`."""
    if planned.questions is not None:
        return decide.assemble(planned, results)
    by_key = {r.key: r for r in results}
    constraints = {r.key: r.params.constraint for r in planned.requests if r.params.constraint is not None}
    part, n = planned.part, planned.n
    rows: list[OutputRow] = []
    for row in range(part.num_rows):
        if row in planned.skipped:
            continue  # generated in run.skip_existing's output already
        for s in range(n if planned.counts is None else planned.counts[row]):
            seed, error = planned.seeds[row * n + s], planned.errors[row]
            if error is not None:
                rows.append(OutputRow(row=row, id=part.ids[row], sample_index=s, generation=None,
                                      finish_reason="error", num_prompt_tokens=0, num_generated_tokens=0,
                                      seed=seed, error=error))
                continue
            res = by_key.pop(row * n + s, None)
            if res is None:
                raise BatchgenError(f"part {part.index}: the engine returned no result for row {part.ids[row]!r} "
                                    f"sample {s}; nothing of this part was committed, rerun to resume")
            rows.append(_sample_row(OutputRow(row=row, id=part.ids[row], sample_index=s, generation=None,
                                              finish_reason=res.finish_reason, seed=seed, error=None,
                                              num_prompt_tokens=res.num_prompt_tokens,
                                              num_generated_tokens=res.num_generated_tokens), res,
                                    constraints.get(row * n + s)))
    if by_key:
        raise BatchgenError(f"part {part.index}: the engine returned results for unknown requests "
                            f"{sorted(by_key)[:5]}; nothing of this part was committed, rerun to resume")
    return rows


def _sample_row(row: OutputRow, res: Result, constraint: Optional[Constraint]) -> OutputRow:
    """A sample's row from its result: its usage, then its generation (checked against its constraint:
    `parsed`, or an invalid_output error), or its error or score where the engine generated nothing."""
    row.cached_prompt_tokens, row.reasoning_tokens = res.cached_prompt_tokens, res.reasoning_tokens
    row.latency_s = res.latency_s
    if res.error is not None or res.loglik is not None or res.embedding is not None:
        row.error = res.error
        return _ungenerated(row, res)
    row.generation, row.reasoning = res.text, res.reasoning
    row.parsed, row.error = check(constraint, res.text, res.finish_reason) if constraint else (None, None)
    row.choice_scores = _labelled(constraint, res.choice_scores)
    row.token_logprobs, row.top_logprobs = res.token_logprobs, _top(res.top_logprobs)
    return row


def _top(top: Optional[list[list[list]]]) -> Optional[list[list[dict[str, Any]]]]:
    if top is None:
        return None
    return [[{"token": t, "token_id": i, "logprob": lp} for i, t, lp in position] for position in top]


def _labelled(constraint: Optional[Constraint], scores: Optional[list[float]]) -> Optional[list[tuple[str, float]]]:
    """The choice_scores map's entries: (label, probability) in choice order."""
    if constraint is None or scores is None:
        return None
    return list(zip(constraint.choices, scores, strict=True))


def _ungenerated(row: OutputRow, res: Result) -> OutputRow:
    """A row the engine answered without a generation: its own error (an endpoint's refusal: finish_reason error),
    or a task=loglik or task=embed score (finish_reason scored)."""
    if res.error is not None:
        row.finish_reason = "error"
        return row
    row.seed = None
    row.embedding = res.embedding
    if res.loglik is not None:
        for name, value in loglik_columns(res.loglik).items():
            setattr(row, name, value)
    return row


def loglik_columns(loglik: list[float]) -> dict[str, Any]:
    """A task=loglik Result's [total, scored tokens] as its columns: total, per-token mean, perplexity, tokens."""
    total, count = loglik[0], int(loglik[1])
    mean = total / count if count else None
    return {"loglik": total, "loglik_mean": mean, "perplexity": None if mean is None else math.exp(-mean),
            "scored_tokens": count}


def price(rows: list[OutputRow], prices: Any) -> None:
    """Each sample's cost under output.prices (per million tokens: `input`, `cached_input` for prompt tokens the
    engine took from a prefix cache, `input` where that price is not given, and `output` for generated ones). Each
    sample is its own request (n=1, its own seed), so each carries its prompt. An input error row and a request the
    endpoint rejected cost 0; a sample the endpoint cut off (endpoint_finish) costs what it reported; a scored row
    (task=loglik, embed) its prompt. The price is that of generating the sample, whether or not this run paid it
    (a cache hit or a duplicate answered once: the summary counts those)."""
    cached_price = prices.input if prices.cached_input is None else prices.cached_input
    for r in rows:
        if r.generation is None and r.finish_reason != "scored" and not r.num_generated_tokens:
            r.cost = 0.0
            continue
        cached = r.cached_prompt_tokens or 0
        r.cost = ((r.num_prompt_tokens - cached) * prices.input + cached * cached_price
                  + r.num_generated_tokens * prices.output) / 1e6
