"""Label scores for the hf engine (sampling.choice_scores): the probability of each of a row's choices given its
prompt, with no sampling.

A row that wants scores becomes one forced sequence per choice: its prompt, then the choice's tokens and EOS fed
in one per decode step (Sampler: Draw.forced), each token's log-probability recorded. These sequences run through
the engine like any other rows: continuous batching, and the prefix cache, which prefills the prompt the choices
share once. A choice's score is the model's probability of its whole token sequence followed by EOS, read from the
logits after the row's logits processors (logit_bias, the penalties: sampler.logged_logprobs), the ones its answer
would be decoded from without scores, so that a
choice that is a prefix of another ("bug", "bugfix") is not credited with the longer one's mass; a row's scores
are normalised over its choices and sum to 1. The row is not decoded freely: its answer is the choice with the
highest score (greedy), or one drawn from the scores with the sample's own seed (temperature > 0: scores ** (1 /
temperature), renormalised), so that the text and the scores always agree. Knows requests and results; which rows
want scores is the request's (SampleParams.choice_scores).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from batchgen.engines.base import Source
from batchgen.records import Request, Result


@dataclass(slots=True)
class ScoredRow:
    request: Request
    logprobs: list[Optional[float]]  # per choice, once its forced sequence is in
    left: int  # choices whose forced sequence is not in yet


class ChoiceScorer:
    def __init__(self, tokenizer: Any, *, eos_id: int):
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self._choice_ids: dict[str, list[int]] = {}
        self.sequences = 0  # (row, choice) sequences scored

    def wants(self, req: Request) -> bool:
        c = req.params.constraint
        return req.params.choice_scores and c is not None and c.kind == "choice"

    def tail(self, choice: str) -> list[int]:
        """The choice's tokens, then EOS: what its forced sequence feeds in."""
        if choice not in self._choice_ids:
            self._choice_ids[choice] = self.tokenizer(choice, add_special_tokens=False)["input_ids"]
        return self._choice_ids[choice] + [self.eos_id]

    def forced(self, req: Request, key: int, choice: str) -> Request:
        """The forced sequence of one of the row's choices: greedy, unconstrained, its log-probabilities recorded."""
        tail = self.tail(choice)
        params = replace(req.params, max_new_tokens=len(tail), temperature=0.0, stop=(), ignore_eos=False,
                         constraint=None, choice_scores=False, logprobs=0, reasoning=None, forced=tuple(tail))
        self.sequences += 1
        return Request(key=key, prompt_ids=req.prompt_ids, params=params, seed=None)

    def answer(self, row: ScoredRow) -> Result:
        """The row's Result: the top choice (greedy) or one drawn from the scores, then EOS."""
        req = row.request
        choices = req.params.constraint.choices  # type: ignore[union-attr]
        scores = torch.softmax(torch.tensor(row.logprobs, dtype=torch.float64), dim=0).tolist()
        if req.params.greedy:
            pick = max(range(len(choices)), key=lambda i: scores[i])
        else:
            weights = torch.tensor(scores, dtype=torch.float64) ** (1.0 / req.params.temperature)
            gen = torch.Generator().manual_seed(req.seed or 0)
            pick = int(torch.multinomial(weights / weights.sum(), 1, generator=gen).item())
        return Result(key=req.key, text=choices[pick], finish_reason="stop", num_prompt_tokens=len(req.prompt_ids),
                      num_generated_tokens=len(self.tail(choices[pick])), choice_scores=scores)


def with_choice_scores(scorer: ChoiceScorer, source: Source, on_result: Callable[[Result], None]
                       ) -> tuple[Source, Callable[[Result], None]]:
    """`source` and `on_result` wrapped: a request that wants scores is replaced by its choices' forced sequences
    (keys of their own, negative: the source's are not), and its Result is made once all of them are in."""
    rows: dict[int, ScoredRow] = {}  # the row's own key -> its scores so far
    routes: dict[int, tuple[int, int]] = {}  # forced sequence's key -> (row key, choice index)
    keys = itertools.count(-1, -1)

    def scored_source() -> Optional[list[Request]]:
        batch = source()
        if not batch:
            return batch
        out = []
        for req in batch:
            if not scorer.wants(req):
                out.append(req)
                continue
            choices = req.params.constraint.choices  # type: ignore[union-attr]
            rows[req.key] = ScoredRow(req, [None] * len(choices), len(choices))
            for c, choice in enumerate(choices):
                key = next(keys)
                routes[key] = (req.key, c)
                out.append(scorer.forced(req, key, choice))
        return out

    def scored_result(result: Result) -> None:
        route = routes.pop(result.key, None)
        if route is None:
            on_result(result)
            return
        row = rows[route[0]]
        row.logprobs[route[1]] = sum(result.token_logprobs or [])
        row.left -= 1
        if row.left == 0:
            del rows[route[0]]
            on_result(scorer.answer(row))

    return scored_source, scored_result
