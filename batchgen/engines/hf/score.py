"""Label scores for the hf engine (sampling.choice_scores): the probability of each of a row's choices given its
prompt, from one forward pass over every (row, choice) sequence of a batch. Such a row is not generated token by
token at all: its answer is the choice with the highest score (greedy), or one drawn from the scores with the
sample's own seed (temperature > 0: scores ** (1 / temperature), renormalised), so that the text and the scores
always agree and the row costs one forward pass.

A choice's score is the model's probability of its whole token sequence followed by the end of the sample (EOS),
so that a choice that is a prefix of another ("bug", "bugfix") is not credited with the longer one's mass; the
scores of a row are then normalised over its choices, and sum to 1. Sequences are left-padded, so that every
choice's tokens sit at the end and only the last few positions' logits are computed. Knows the model's forward and
token ids; which rows want scores is the request's (SampleParams.choice_scores).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from batchgen.engines.base import Source
from batchgen.engines.hf.generic import left_pad
from batchgen.records import Request, Result


class ChoiceScorer:
    def __init__(self, model: Any, tokenizer: Any, *, eos_id: int, pad_id: int, device: torch.device,
                 max_batch_tokens: int):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self._choice_ids: dict[str, list[int]] = {}
        self.sequences = 0  # (row, choice) sequences scored
        self.forward_passes = 0

    def wants(self, req: Request) -> bool:
        c = req.params.constraint
        return req.params.choice_scores and c is not None and c.kind == "choice"

    def scores(self, requests: list[Request]) -> dict[int, list[float]]:
        """Request key -> its choices' probabilities (in choice order) for every request that wants them."""
        seqs: list[tuple[int, list[int], int]] = []  # (request index, prompt + choice + EOS, scored tokens)
        wanted = [r for r in requests if self.wants(r)]
        for i, req in enumerate(wanted):
            for choice in req.params.constraint.choices:  # type: ignore[union-attr]
                tail = self._ids(choice) + [self.eos_id]
                seqs.append((i, list(req.prompt_ids) + tail, len(tail)))
        logprob = [0.0] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda j: -len(seqs[j][1]))
        start = 0
        while start < len(order):  # batches under the token budget, longest first
            width, end = len(seqs[order[start]][1]), start + 1
            while end < len(order) and (end - start + 1) * width <= self.max_batch_tokens:
                end += 1
            batch = order[start:end]
            for j, value in zip(batch, self._logprobs([seqs[j][1] for j in batch], [seqs[j][2] for j in batch])):
                logprob[j] = value
            start = end
        out: dict[int, list[float]] = {}
        at = 0
        for req in wanted:
            n = len(req.params.constraint.choices)  # type: ignore[union-attr]
            probs = torch.softmax(torch.tensor(logprob[at:at + n], dtype=torch.float64), dim=0)
            out[req.key] = probs.tolist()
            at += n
        return out

    def _ids(self, choice: str) -> list[int]:
        if choice not in self._choice_ids:
            self._choice_ids[choice] = self.tokenizer(choice, add_special_tokens=False)["input_ids"]
        return self._choice_ids[choice]

    def _logprobs(self, seqs: list[list[int]], scored: list[int]) -> list[float]:
        """Sum of log p(token | everything before it) over each sequence's last `scored` tokens."""
        width, keep = max(len(s) for s in seqs), max(scored) + 1
        ids, mask, positions = left_pad(seqs, self.pad_id, self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                            logits_to_keep=keep).logits.float()  # [B, keep, V]: positions width-keep .. width-1
        self.forward_passes += 1
        self.sequences += len(seqs)
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # predicts tokens width-keep+1 .. width-1
        targets = ids[:, width - keep + 1:]
        picked = logp.gather(-1, targets[..., None])[..., 0]  # [B, keep - 1]
        return [float(picked[b, keep - 1 - n:].sum()) for b, n in enumerate(scored)]


    def answer(self, req: Request, scores: list[float]) -> Result:
        """The scored request's Result: the top choice (greedy) or one drawn from the scores, then EOS."""
        choices = req.params.constraint.choices  # type: ignore[union-attr]
        if req.params.greedy:
            pick = max(range(len(choices)), key=lambda i: scores[i])
        else:
            weights = torch.tensor(scores, dtype=torch.float64) ** (1.0 / req.params.temperature)
            gen = torch.Generator().manual_seed(req.seed or 0)
            pick = int(torch.multinomial(weights / weights.sum(), 1, generator=gen).item())
        return Result(key=req.key, text=choices[pick], finish_reason="stop", num_prompt_tokens=len(req.prompt_ids),
                      num_generated_tokens=len(self._ids(choices[pick])) + 1, choice_scores=scores)

    def answer_all(self, requests: list[Request], on_result: Callable[[Result], None]) -> list[Request]:
        """Answer the requests that want scores (on_result each) and return the others, to be generated."""
        scores = self.scores(requests)
        for req in requests:
            if req.key in scores:
                on_result(self.answer(req, scores[req.key]))
        return [r for r in requests if r.key not in scores]


def with_choice_scores(scorer: ChoiceScorer, source: Source, on_result: Callable[[Result], None]) -> Source:
    """`source` wrapped: the requests that want scores are answered from their scores as they arrive (a batch at a
    time) and never reach the decode loop; the rest pass on."""
    def scored_source() -> Optional[list[Request]]:
        while True:
            batch = source()
            if not batch:
                return batch  # None: no more; []: none right now (the answered rows' parts have made room by then)
            rest = scorer.answer_all(batch, on_result)
            if rest:
                return rest

    return scored_source
