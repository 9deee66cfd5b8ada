"""task=decide's output rows: one per input row, one struct column per question.

Each question's answers were scored by the engine as log-likelihoods (of " answer" then EOS, after the row's prompt
and the question's); here they become probabilities, softmax over the question's answers (a predicate's yes and no
normalised to sum to 1, a choice's options, a score's levels 1..N), the top answer and its probability
(`confidence`), and for a score the expected level. A row whose top answer for some question falls below that
question's abstain_below is marked needs_review. Knows Results and rows, not models.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pyarrow as pa

from batchgen.errors import BatchgenError
from batchgen.records import OutputRow, PlannedPart, Result

DECISION = pa.struct([("answer", pa.string()), ("confidence", pa.float64()),
                      ("probabilities", pa.list_(pa.struct([("answer", pa.string()), ("p", pa.float64())]))),
                      ("expected", pa.float64())])
NEEDS_REVIEW = pa.field("needs_review", pa.bool_())


def decision(kind: str, answers: tuple[str, ...], logliks: list[float]) -> dict[str, Any]:
    top = max(logliks)
    weights = [math.exp(x - top) for x in logliks]
    total = sum(weights)
    probs = [w / total for w in weights]
    best = max(range(len(answers)), key=lambda i: probs[i])
    expected = sum((i + 1) * p for i, p in enumerate(probs)) if kind == "score" else None
    return {"answer": answers[best], "confidence": probs[best],
            "probabilities": [{"answer": a, "p": p} for a, p in zip(answers, probs)], "expected": expected}


def assemble(planned: PlannedPart, results: list[Result]) -> list[OutputRow]:
    """The part's rows in input order: a decision per question, or the row's error."""
    questions = planned.questions or ()
    width = sum(len(answers) for _, _, answers, _ in questions)
    by_key = {r.key: r for r in results}
    shared = {r.key: r.params.shared for r in planned.requests}  # a request's row prompt length
    part, rows = planned.part, []
    for row in range(part.num_rows):
        if row in planned.skipped:
            continue
        error = planned.errors[row]
        if error is not None:
            rows.append(OutputRow(row=row, id=part.ids[row], sample_index=0, generation=None, finish_reason="error",
                                  num_prompt_tokens=0, num_generated_tokens=0, seed=None, error=error))
            continue
        got = [by_key.pop(row * width + j, None) for j in range(width)]
        if any(r is None for r in got):
            raise BatchgenError(f"part {part.index}: the engine returned no score for row {part.ids[row]!r}; nothing "
                                f"of this part was committed, rerun to resume")
        failed = next((r for r in got if r.error is not None), None)
        if failed is not None:
            rows.append(OutputRow(row=row, id=part.ids[row], sample_index=0, generation=None, finish_reason="error",
                                  num_prompt_tokens=failed.num_prompt_tokens, num_generated_tokens=0, seed=None,
                                  error=failed.error))
            continue
        decisions, review, j = {}, False, 0
        for name, kind, answers, abstain in questions:
            decisions[name] = decision(kind, answers, [r.loglik[0] for r in got[j:j + len(answers)]])
            review = review or (abstain is not None and decisions[name]["confidence"] < abstain)
            j += len(answers)
        rows.append(OutputRow(row=row, id=part.ids[row], sample_index=0, generation=None, finish_reason="scored",
                              num_prompt_tokens=shared[row * width],
                              num_generated_tokens=0, seed=None, error=None, decisions=decisions,
                              needs_review=review))
    if by_key:
        raise BatchgenError(f"part {part.index}: the engine returned scores for unknown requests "
                            f"{sorted(by_key)[:5]}; nothing of this part was committed, rerun to resume")
    return rows


def columns(rows: list[OutputRow], names: list[str]) -> dict[str, pa.Array]:
    """The question columns and needs_review, for the part's table."""
    out = {name: pa.array([(r.decisions or {}).get(name) for r in rows], DECISION) for name in names}
    out["needs_review"] = pa.array([r.needs_review for r in rows], pa.bool_())
    return out


def fields(names: list[str]) -> list[pa.Field]:
    return [pa.field(name, DECISION) for name in names] + [NEEDS_REVIEW]


def question_names(task: str, decide: Any) -> Optional[list[str]]:
    """task=decide's question columns, from its `decide` config (None for other tasks)."""
    return [q.name for q in decide.questions] if task == "decide" else None
