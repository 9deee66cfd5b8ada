"""Beam search for the hf engine (sampling.num_beams > 1): a row's beams share its prompt in the cache, and its best
`n` hypotheses come out as its samples, ranked.

The prompt is prefilled once, at batch 1, and its keys and values repeated for the beams; then every decode step
runs the row's beams as one batch through the model's own forward (any architecture, a DynamicCache reordered by
the beams kept). The search follows transformers' beam search (5.x) step for step, so that greedy float32 output
equals `generate(num_beams=...)`: log-softmax scores accumulated per beam; the top max(2, 1 + #EOS) * num_beams
continuations over beams x vocabulary; a continuation that ends in EOS, or reaches max_new_tokens, is finished
with its score divided by (generated length ** length_penalty) and competes for the num_beams finished slots (only
those among the top num_beams candidates); the rest continue; the search stops when no running beam can beat the
worst finished one (early_stopping false: the heuristic at the current length; "never": at the longest length a
positive length_penalty could reach; true: as soon as num_beams hypotheses are finished).

Knows the model's forward and token ids; requests come through `with_beams`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from batchgen.engines.base import Source
from batchgen.records import Request, Result

NEG = -1.0e9


@dataclass(slots=True)
class Hypothesis:
    tokens: list[int]  # generated tokens, the EOS that ended it included
    score: float  # sum of log-probabilities / (len(tokens) ** length_penalty)
    eos: bool


def search(model: Any, prompt_ids: list[int], *, num_beams: int, max_new_tokens: int, eos_ids: set[int],
           length_penalty: float, early_stopping: Union[bool, str], device: torch.device) -> list[Hypothesis]:
    """The row's num_beams best hypotheses, best first."""
    logits, cache, kw = _start(model, prompt_ids, num_beams, device)
    eos = torch.tensor(sorted(eos_ids), device=device)
    keep = max(2, 1 + len(eos_ids)) * num_beams
    running = torch.zeros((num_beams, max_new_tokens), dtype=torch.long, device=device)
    running_scores = torch.full((num_beams,), NEG, device=device)
    running_scores[0] = 0.0  # beams start identical: only the first one expands at the first step
    done = _Finished.empty(num_beams, max_new_tokens, device)
    improvable = True
    for t in range(max_new_tokens):
        vocab = logits.shape[-1]
        total = (torch.log_softmax(logits, dim=-1) + running_scores[:, None]).reshape(-1)
        top_scores, top_index = torch.topk(total, keep)
        parent, token = top_index // vocab, top_index % vocab
        seqs = running[parent].clone()
        seqs[:, t] = token
        ends = torch.isin(token, eos) | (t + 1 >= max_new_tokens)
        # finished: the candidates among the top num_beams that end here, against those finished before
        finishing = ends & (torch.arange(keep, device=device) < num_beams)
        blocked = (early_stopping is True and bool(done.full.all())) or not improvable
        done = done.merge(seqs, top_scores / ((t + 1) ** length_penalty), finishing, t + 1, blocked)
        # running: the best num_beams candidates that do not end here
        alive = top_scores + ends.float() * NEG
        nxt = torch.topk(alive, num_beams).indices
        running, running_scores = seqs[nxt], alive[nxt]
        # stop when no running beam can beat the worst finished one (transformers' heuristic)
        length = max_new_tokens if early_stopping == "never" and length_penalty > 0.0 else t + 1
        worst = float(done.scores.min()) if bool(done.full.all()) else NEG
        improvable = improvable and float(running_scores[0]) / (length ** length_penalty) > worst
        if not improvable or (bool(done.full.all()) and early_stopping is True) or bool(ends.all()):
            break
        cache.reorder_cache(parent[nxt])
        out = model(input_ids=running[:, t:t + 1], use_cache=True, **{kw: cache})
        logits = out.logits[:, -1, :].float()
    return done.hypotheses(eos_ids)


def _start(model: Any, prompt_ids: list[int], num_beams: int, device: torch.device) -> tuple[torch.Tensor, Any, str]:
    """The prompt run once: its last token's logits for each beam [num_beams, V], its cache repeated per beam, and
    the name the model's forward takes that cache by (transformers 5.2x renamed it)."""
    import inspect

    from transformers import DynamicCache

    cache = DynamicCache()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, **{kw: cache})
    cache.batch_repeat_interleave(num_beams)
    return out.logits[:, -1, :].float().expand(num_beams, -1), cache, kw


@dataclass(frozen=True)
class _Finished:
    """The num_beams best finished hypotheses so far: tokens [num_beams, max_new_tokens], length-penalized scores
    (NEG: none yet), lengths, and whether each slot holds a finished hypothesis (not a placeholder)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    lengths: torch.Tensor
    full: torch.Tensor

    @staticmethod
    def empty(num_beams: int, max_new_tokens: int, device: torch.device) -> _Finished:
        return _Finished(torch.zeros((num_beams, max_new_tokens), dtype=torch.long, device=device),
                         torch.full((num_beams,), NEG, device=device),
                         torch.zeros((num_beams,), dtype=torch.long, device=device),
                         torch.zeros((num_beams,), dtype=torch.bool, device=device))

    def merge(self, seqs: torch.Tensor, scored: torch.Tensor, finishing: torch.Tensor, length: int,
              blocked: bool) -> _Finished:
        """These and the candidates that finish here (`finishing`; `scored` length-penalized; none where
        `blocked`), the best num_beams."""
        merged = torch.cat((self.scores, torch.where(finishing & (not blocked), scored, scored + NEG)))
        best = torch.topk(merged, len(self.scores)).indices
        lengths = torch.full((len(seqs),), length, device=self.lengths.device)
        return _Finished(torch.cat((self.tokens, seqs))[best], merged[best],
                         torch.cat((self.lengths, lengths))[best], torch.cat((self.full, finishing))[best])

    def hypotheses(self, eos_ids: set[int]) -> list[Hypothesis]:
        return [Hypothesis(self.tokens[i, :int(self.lengths[i])].tolist(), float(self.scores[i]),
                           int(self.tokens[i, int(self.lengths[i]) - 1]) in eos_ids)
                for i in range(len(self.scores)) if float(self.scores[i]) > NEG / 2]


class BeamSearcher:
    def __init__(self, model: Any, tokenizer: Any, eos_ids: set[int], device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.device = device
        self.rows = 0  # rows searched

    @staticmethod
    def wants(req: Request) -> bool:
        return req.params.num_beams > 1

    @torch.inference_mode()
    def results(self, reqs: list[Request]) -> list[Result]:
        """One row's sample requests (the same prompt and params, ranks 0..n-1): a Result per rank."""
        p = reqs[0].params
        hyps = search(self.model, reqs[0].prompt_ids, num_beams=p.num_beams, max_new_tokens=p.max_new_tokens,
                      eos_ids=set() if p.ignore_eos else self.eos_ids, length_penalty=p.length_penalty,
                      early_stopping=p.early_stopping, device=self.device)
        self.rows += 1
        out = []
        for req in reqs:
            hyp = hyps[min(req.params.beam_rank, len(hyps) - 1)]
            out.append(Result(key=req.key, text=self.tokenizer.decode(hyp.tokens, skip_special_tokens=True),
                              finish_reason="stop" if hyp.eos else "length", num_prompt_tokens=len(req.prompt_ids),
                              num_generated_tokens=len(hyp.tokens)))
        return out


def with_beams(searcher: BeamSearcher, source: Source, on_result: Callable[[Result], None]) -> Source:
    """`source` wrapped: beam requests are searched as they arrive (a row's ranks together, once all of them are
    in) and answered through `on_result`; the rest go on to the engine's batch."""
    waiting: dict[tuple, list[Request]] = {}  # a row's ranks so far, by (prompt, params without the rank)

    def beam_source() -> Optional[list[Request]]:
        while True:
            batch = source()
            if not batch:
                return batch
            out = []
            for req in batch:
                if not searcher.wants(req):
                    out.append(req)
                    continue
                group = (tuple(req.prompt_ids), replace(req.params, beam_rank=0))
                waiting.setdefault(group, []).append(req)
                if len(waiting[group]) == req.params.beam_count:
                    for result in searcher.results(sorted(waiting.pop(group), key=lambda r: r.params.beam_rank)):
                        on_result(result)
            if out:
                return out

    return beam_source
