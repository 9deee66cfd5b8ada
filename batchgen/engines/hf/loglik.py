"""task=loglik and task=embed on the hf engine: each request's log-likelihood of its tokens from `params.score_from`
on, given the tokens before them, or its final hidden states pooled into an embedding (`params.pooling`); no
generation.

Requests are prefill-only: they are scored as they arrive, never queued behind decodes. Longest first, in groups
within engine.max_batch_tokens, each prompt of a group one prefill of the Llama-family step (fused projections,
batchgen's kernels; every token's final hidden state) or of the model's own forward elsewhere; the LM head runs
only over the scored positions, a row at a time, and log-softmax in float32.

A row's scores are the same bits in any batch: each prompt is prefilled alone, and a decide row's answers are
prefilled together as one fixed batch, the row's whole answer set in its plan order after the row's shared prefix,
whatever part of it is asked; so no sum of a row's depends on which rows share its group, their padding or its place
among them, and the threads are the engine's configured count whatever a thread governor set for decode steps; a
resumed job (other groups, a row's remaining answers) writes what an uninterrupted one did. Groups still bound the
work per call by engine.max_batch_tokens.

A row longer than engine.max_model_len is scored in windows of that many tokens: the first window scores its
tokens from score_from; each next one starts half a window later and scores only its second half, so every token
is scored once, with at least half a window of context before it (the sliding-window perplexity of the
transformers docs). Knows token ids and the model, not rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from batchgen.engines.base import Source
from batchgen.records import Request, Result

Span = tuple[list[int], int]  # (token ids, the first position scored)
Answers = tuple[tuple[int, ...], ...]  # task=decide: a row's answers, each its tokens after the row's shared prefix
HEAD_CHUNK = 256  # scored positions per LM-head call: 256 x a 152k vocabulary of float32 logits is 155 MB


def wants(req: Request) -> bool:
    """A prefill-only request: task=loglik (score_from) or task=embed (pooling)."""
    return req.params.score_from is not None or req.params.pooling is not None


def windows(ids: list[int], first: int, width: int) -> list[Span]:
    """The spans that score ids[first:] once each within `width` tokens (see the module docstring)."""
    if len(ids) <= width:
        return [(ids, first)]
    half = max(width // 2, 1)
    out: list[Span] = [(ids[:width], first)]
    start = half
    while start + width < len(ids) + half:
        end = min(start + width, len(ids))
        out.append((ids[start:end], max(width - half, first - start)))
        start += half
    return [(span, at) for span, at in out if at < len(span)]


class LoglikScorer:
    def __init__(self, model: Any, stepper: Optional[Any], device: torch.device, *, max_len: int,
                 max_batch_tokens: int, threads: Optional[int] = None):
        self.model, self.stepper, self.device = model, stepper, device
        self.max_len, self.max_batch_tokens = max_len, max_batch_tokens
        self.threads = threads  # torch's threads while scoring (the engine's configured count); None: as set
        self.tokens = 0  # tokens prefilled for scoring

    @torch.inference_mode()
    def score(self, requests: list[Request]) -> list[Result]:
        """One Result per request, in request order: loglik = [summed log-probability, scored tokens], or for a
        pooling request its embedding."""
        with self._pinned_threads():
            return self._score(requests)

    @contextlib.contextmanager
    def _pinned_threads(self) -> Iterator[None]:
        """torch's threads at self.threads for the call, then as they were (a governor's cut for decode steps)."""
        before = torch.get_num_threads()
        if self.threads and before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _score(self, requests: list[Request]) -> list[Result]:
        if requests and requests[0].params.pooling is not None:
            return self._embed(requests)
        if self.stepper is not None and requests and all(r.params.shared > 0 for r in requests):
            return self._shared(requests)
        spans = [(i, span) for i, r in enumerate(requests)
                 for span in windows(r.prompt_ids, max(r.params.score_from, 1), self.max_len)]
        spans.sort(key=lambda item: -len(item[1][0]))
        totals = [[0.0, 0] for _ in requests]
        start = 0
        while start < len(spans):
            width = len(spans[start][1][0])
            end = min(len(spans), start + max(1, self.max_batch_tokens // width))
            for (i, _), (total, count) in zip(spans[start:end], self._group([s for _, s in spans[start:end]])):
                totals[i][0] += total
                totals[i][1] += count
            start = end
        return [Result(key=r.key, text="", finish_reason="scored", num_prompt_tokens=len(r.prompt_ids),
                       num_generated_tokens=0, loglik=[float(t), int(c)]) for r, (t, c) in zip(requests, totals)]

    def _embed(self, requests: list[Request]) -> list[Result]:
        """Each request's final hidden states pooled (mean over its tokens, or its last token's), in float32, then
        scaled to unit length where asked; longest first in groups within max_batch_tokens."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
        pooled: list[list[float]] = [[] for _ in requests]
        start = 0
        while start < len(order):
            group = order[start:start + max(1, self.max_batch_tokens // len(requests[order[start]].prompt_ids))]
            hidden = self._hidden([requests[i].prompt_ids for i in group]).float()
            offset = 0
            for i in group:
                req = requests[i]
                states = hidden[offset:offset + len(req.prompt_ids)]
                vector = states.mean(dim=0) if req.params.pooling == "mean" else states[-1]
                if req.params.normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
                pooled[i] = vector.tolist()
                offset += len(req.prompt_ids)
            self.tokens += offset
            start += len(group)
        return [Result(key=r.key, text="", finish_reason="scored", num_prompt_tokens=len(r.prompt_ids),
                       num_generated_tokens=0, embedding=v) for r, v in zip(requests, pooled)]

    def _shared(self, requests: list[Request]) -> list[Result]:
        """task=decide: a row's requests share their first `params.shared` tokens (its prompt), prefilled once; then
        the row's whole answer set (params.answers; without it, the answers asked) is prefilled as one batch after
        it, whatever part of the set is asked (a resumed row's remaining answers, a cache's misses)."""
        rows: dict[tuple[tuple[int, ...], Answers], list[int]] = {}
        for i, r in enumerate(requests):
            rows.setdefault((tuple(r.prompt_ids[:r.params.shared]), r.params.answers), []).append(i)
        totals: list[tuple[float, int]] = [(0.0, 0)] * len(requests)
        for (prefix, answers), members in rows.items():
            asked = [requests[i] for i in members]
            answers = answers or tuple(dict.fromkeys(tuple(r.prompt_ids[len(prefix):]) for r in asked))
            for i, total in zip(members, self._row(list(prefix), answers, asked)):
                totals[i] = total
        return [Result(key=r.key, text="", finish_reason="scored", num_prompt_tokens=len(r.prompt_ids),
                       num_generated_tokens=0, loglik=[t, c]) for r, (t, c) in zip(requests, totals)]

    def _row(self, prefix: list[int], answers: Answers, asked: list[Request]) -> list[tuple[float, int]]:
        """The asked requests' scores, from one row's prefix and its whole answer set prefilled in the set's order,
        in chunks of answers within max_batch_tokens: the batches' make-up and shapes depend on the row alone (each
        answer attends over the prefix and itself only), so its bits do not depend on which rows or answers a call
        holds."""
        cache = self.stepper.new_cache(1, len(prefix))
        self.stepper.prefill(cache, 0, [prefix])
        k, v = cache.prefix_of(0, len(prefix))
        self.tokens += len(prefix)
        step = max(1, self.max_batch_tokens // max(map(len, answers)))
        hidden: dict[tuple[int, ...], torch.Tensor] = {}
        for start in range(0, len(answers), step):
            hidden.update(zip(answers[start:start + step], self._suffixes(prefix, answers[start:start + step], k, v)))
        out = []
        for r in asked:
            own = hidden.get(tuple(r.prompt_ids[len(prefix):]))
            if own is None:
                raise ValueError(f"request {r.key}: its tokens after the shared prefix are not among its row's "
                                 f"params.answers ({len(answers)} answers)")
            # own[t] is position len(prefix) + t's state, which predicts ids[len(prefix) + t + 1]
            out.append(self._span(own, -len(prefix), r.prompt_ids, r.params.score_from))
        return out

    def _suffixes(self, prefix: list[int], answers: Answers, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """Each answer's final hidden states [len(answer), hidden], the answers one prefill after the prefix's keys
        and values, loaded into each one's slot: packed in the given order, right-padded to the longest for
        attention, which sees the slot's own prefix and tokens only."""
        cache = self.stepper.new_cache(len(answers), len(prefix) + max(map(len, answers)))
        for slot in range(len(answers)):
            cache.load_prefix(slot, k, v)
        prompts = [prefix + list(a) for a in answers]
        hidden = self.stepper.prefill_hidden(cache, 0, prompts, [len(prefix)] * len(answers))
        self.tokens += hidden.shape[0]
        return list(torch.split(hidden, [len(a) for a in answers]))

    def _span(self, hidden: torch.Tensor, base: int, ids: list[int], at: int) -> tuple[float, int]:
        """The summed log-probability of ids[at:] and how many tokens that is, where hidden[base + t] is the state
        at ids' position t (it predicts ids[t + 1]). The LM head runs over HEAD_CHUNK positions at a time: [chunk,
        vocabulary] logits, never [row, vocabulary]."""
        head, total = self.model.get_output_embeddings(), 0.0
        for lo in range(at, len(ids), HEAD_CHUNK):
            hi = min(lo + HEAD_CHUNK, len(ids))
            logp = torch.log_softmax(head(hidden[base + lo - 1: base + hi - 1]).float(), dim=-1)
            target = torch.tensor(ids[lo:hi], device=logp.device)
            total += logp.gather(1, target[:, None]).double().sum().item()
        return total, len(ids) - at

    def _group(self, spans: list[Span]) -> list[tuple[float, int]]:
        hidden = self._hidden([ids for ids, _ in spans])
        out, offset = [], 0
        for ids, at in spans:
            out.append(self._span(hidden, offset, ids, at))
            offset += len(ids)
        self.tokens += offset
        return out

    def _hidden(self, prompts: list[list[int]]) -> torch.Tensor:
        """Every token's final hidden state, packed [N, hidden] in prompt order, each prompt prefilled alone: a GEMM
        over packed tokens sums a token by where it lands among the batch's (the kernel's last, partial tile of rows
        differs), and a padded batch's width changes attention's sums, so a row in other company scored other bits."""
        if self.stepper is not None:
            cache = self.stepper.new_cache(1, max(map(len, prompts)))
            return torch.cat([self.stepper.prefill_hidden(cache, 0, [p]) for p in prompts])
        return torch.cat([self.model.base_model(input_ids=torch.tensor([p], device=self.device)).last_hidden_state[0]
                          for p in prompts])


def with_loglik(scorer: Callable[[], LoglikScorer], source: Source, on_result: Callable[[Result], None]) -> Source:
    """`source` wrapped: requests that want their log-likelihood (task=loglik) are scored at once and their Results
    handed on; the rest go to the engine. It asks `source` again after scoring, so the engine is never handed an
    empty list while the job still has work."""
    def scored_source() -> Optional[list[Request]]:
        while True:
            batch = source()
            if not batch:
                return batch
            rest = [r for r in batch if not wants(r)]
            scored = [r for r in batch if wants(r)]
            for kind in ([r for r in scored if r.params.pooling is None], [r for r in scored if r.params.pooling]):
                for result in scorer().score(kind) if kind else ():
                    on_result(result)
            if rest or not scored:
                return rest

    return scored_source

