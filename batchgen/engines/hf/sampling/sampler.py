"""Token choice and finishing for the hf engine: greedy or seeded sampling per row, EOS, stop strings,
the row's own cap, structured-output constraints (grammar.py: a matcher per constrained sample masks its
logits), the logits processors (processors.py: penalties, logit_bias and min_tokens, applied once to the logits
before the draw and before a greedy row's argmax), the draw itself (draw.py: the same on every device, each seeded
row's noise from its seed and its step), and the Result a finished sequence becomes.

Both decode paths (the scheduler over the slot cache, and the generic path for any architecture) ask
the same Sampler, so a row finishes and reads the same whichever path served it. Knows token ids,
sampling params and the tokenizer; nothing about caches, slots, models or devices (a platform's faster ops come in
as draw.DrawOps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchgen.engines.base import answer_text, reasoning_tokens, split_answer, with_tokens
from batchgen.engines.hf.sampling import processors
from batchgen.engines.hf.sampling.draw import TORCH_OPS, DrawOps, RowParams, sample
from batchgen.records import Request, Result
from batchgen.sampling import SampleParams, find_stop


@dataclass(slots=True)
class Draw:
    """A sample's own token-choice state, made when it arrives and kept until it finishes."""

    seed: Optional[int]  # a sampled row's seed (with `drawn`, its noise: draw.py); None for greedy
    matcher: Any = None  # its xgrammar GrammarMatcher, for a constrained sample
    token_logprobs: Optional[list[float]] = None  # sampling.logprobs: each picked token's log-probability
    top_logprobs: Optional[list[list[list]]] = None  # and the top k per position, [token_id, logprob] pairs
    thinking: bool = False  # inside its reasoning block (SampleParams.reasoning): unconstrained until it ends
    thought: int = 0  # tokens generated while thinking
    tail: tuple[int, ...] = ()  # the last tokens, to see the end marker complete
    forced: Optional[list[int]] = None  # tokens still to feed in: a scored choice's, or the reasoning end marker
    drawn: int = 0  # tokens picked so far: the step of the next draw
    shaped: bool = False  # a logits processor applies (SampleParams.shapes_logits)
    history: Optional[processors.History] = None  # its penalties' token history, made at its first step


class Sampler:
    def __init__(self, tokenizer: Any, eos_ids: set[int], device: torch.device, vocab_size: Optional[int] = None,
                 ops: DrawOps = TORCH_OPS):
        """ops: the platform's kernels for the draw's steps (Backend.draw_ops), which change no token; the default
        is plain torch."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.device = device
        self.vocab_size = vocab_size  # the model's logits width (None: the tokenizer's length)
        self.ops = ops
        self._grammars: Any = None  # grammar.Grammars, made at the first constrained request

    def start(self, req: Request) -> Draw:
        """A new sample's Draw: its seed (None for greedy), its grammar matcher where it is constrained."""
        if not req.params.greedy and req.seed is None:
            raise ValueError(f"request {req.key}: a sampled row needs a seed (sampling.derive_seed)")
        constraint = req.params.constraint
        draw = Draw(None if req.params.greedy else req.seed,
                    self.grammars().matcher(constraint) if constraint is not None else None)
        if req.params.logprobs is not None:
            draw.token_logprobs, draw.top_logprobs = [], []
        draw.thinking = req.params.reasoning is not None
        if req.params.forced:
            draw.forced = list(req.params.forced)
        draw.shaped = req.params.shapes_logits
        return draw

    def grammars(self) -> Any:
        if self._grammars is None:
            from batchgen.engines.hf.sampling.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.vocab_size or len(self.tokenizer), self.eos_ids)
        return self._grammars

    def pick(self, logits: torch.Tensor, reqs: list[Request], draws: list[Draw],
             picks: Optional[torch.Tensor] = None) -> list[int]:
        """Next token per row; a constrained row picks among the tokens its grammar allows, and its matcher
        takes the token. picks: each row's argmax of these logits where the step computed it (used for greedy rows
        unless a processor or a grammar changes their logits)."""
        logged = [j for j, d in enumerate(draws) if d.token_logprobs is not None]
        raw, shaped = logits, [j for j, d in enumerate(draws) if d.shaped]
        if shaped:
            logits, picks = self._process(logits, reqs, draws, shaped, picks)
        logp = logged_logprobs(raw, logits, [reqs[j] for j in logged], logged) if logged else None
        matchers = [None if d.thinking else d.matcher for d in draws]  # a thinking row is free until its block ends
        constrained = self._grammars is not None and any(m is not None for m in matchers)
        if constrained:
            logits, picks = self._grammars.mask(logits, matchers), None
        tokens = self._choose(logits, reqs, draws, picks)
        for j, d in enumerate(draws):
            d.drawn += 1
            if d.forced:
                tokens[j] = d.forced.pop(0)
        for j in shaped:
            draws[j].history.take(tokens[j])  # type: ignore[union-attr]
        if logp is not None:
            record_logprobs(logp, [draws[j] for j in logged], [tokens[j] for j in logged],
                            [reqs[j].params.logprobs or 0 for j in logged])
        for token, req, d, m in zip(tokens, reqs, draws, matchers):
            if d.thinking:
                self._think(req, d, token)
            elif m is not None and not m.is_terminated():
                m.accept_token(token)
        return tokens

    def _choose(self, logits: torch.Tensor, reqs: list[Request], draws: list[Draw], picks: Optional[torch.Tensor]
                ) -> list[int]:
        """Each row's token: greedy rows the step's `picks` where given, else the platform's argmax; sampled rows the
        draw (draw.sample), all at once: one host read for all of them."""
        drawn = [j for j, d in enumerate(draws) if d.seed is not None]
        tokens = [0] * len(draws)
        if len(drawn) < len(draws):
            tokens = (picks if picks is not None else self.ops.argmax(logits)).tolist()
        if drawn:
            rows = logits if len(drawn) == len(draws) else logits[torch.tensor(drawn, device=logits.device)]
            params = RowParams.of_rows([reqs[j].params for j in drawn], [draws[j].seed for j in drawn], logits.device)
            steps = torch.tensor([draws[j].drawn for j in drawn], dtype=torch.int64).to(logits.device,
                                                                                       non_blocking=True)
            for j, token in zip(drawn, sample(rows, params, steps, self.ops).tolist()):
                tokens[j] = token
        return tokens

    def _process(self, logits: torch.Tensor, reqs: list[Request], draws: list[Draw], shaped: list[int],
                 picks: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The logits with the `shaped` rows' processors applied, and the step's picks with those rows' argmax
        taken again from them (a penalised greedy row picks from its penalised logits)."""
        for j in shaped:
            if draws[j].history is None:
                draws[j].history = processors.History.start(reqs[j].params, reqs[j].prompt_ids, logits.shape[-1],
                                                            logits.device, self.bad_words(reqs[j].params.bad_words))
        logits = processors.apply(logits, shaped, [reqs[j].params for j in shaped],
                                  [draws[j].history for j in shaped],  # type: ignore[misc]
                                  [draws[j].drawn for j in shaped], sorted(self.eos_ids))
        if picks is not None:
            index = torch.tensor(shaped, device=picks.device)
            picks = picks.clone().index_copy_(0, index, logits.index_select(0, index).max(dim=-1).indices)
        return logits, picks

    def bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences (SamplingParams.update_from_tokenizer): each word (its leading spaces
        dropped) as it starts a text, and with a leading space where that is another first token and as many tokens
        (the word inside a text)."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out += [alone] + ([spaced] if spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else [])
        return tuple(out)

    def _think(self, req: Request, d: Draw, token: int) -> None:
        """A thinking row took `token`: its block ends when the end marker is complete (the constraint applies from
        the next token); past max_reasoning_tokens the marker is forced, one token a step."""
        reasoning = req.params.reasoning
        assert reasoning is not None
        d.thought += 1
        d.tail = (*d.tail, token)[-len(reasoning.end_ids):]
        if d.tail == reasoning.end_ids:
            d.thinking, d.forced = False, None
        elif reasoning.max_tokens is not None and d.thought >= reasoning.max_tokens and d.forced is None:
            d.forced = list(reasoning.end_ids)

    def finish_reason(self, params: SampleParams, generated: list[int], draw: Optional[Draw] = None
                      ) -> Optional[str]:
        if not params.ignore_eos and generated[-1] in self.eos_ids or generated[-1] in params.stop_token_ids:
            return "stop"  # vLLM's ignore_eos leaves stop_token_ids stopping
        if draw is not None and draw.matcher is not None and not draw.thinking and draw.matcher.is_terminated():
            return "stop"  # the grammar is complete and took its stop token
        if params.stop and len(generated) > params.min_tokens and self._ends_in_stop(generated, params):
            return "stop"
        if len(generated) >= params.max_new_tokens:
            return "length"
        return None

    def _ends_in_stop(self, generated: list[int], params: SampleParams) -> bool:
        """Whether a stop string ends in the newest token, read from the text of the last tokens only, enough to
        hold any: checking the whole generation every step would cost O(length^2) per row. A character takes at
        most 4 tokens (byte-level fallback), and the margin keeps a match clear of the window's first
        token, whose decoding can differ from its decoding in context (a leading space). A match within the first
        min_tokens tokens does not count (answer_text)."""
        window = 4 * max(len(s) for s in params.stop) + 8
        start = max(0, len(generated) - window)
        text = self.tokenizer.decode(generated[start:], skip_special_tokens=True)
        head = generated[start:params.min_tokens]
        after = len(self.tokenizer.decode(head, skip_special_tokens=True)) if head else 0
        return find_stop(text, params.stop, after) >= 0

    def make_result(self, req: Request, generated: list[int], reason: Optional[str], draw: Optional[Draw] = None
                    ) -> Result:
        answer, reasoning = split_answer(self.tokenizer, generated, req.params)
        text = answer_text(self.tokenizer, generated, answer, req.params)
        return Result(key=req.key, text=text, finish_reason=reason or "length",
                      num_prompt_tokens=len(req.prompt_ids), num_generated_tokens=len(generated), reasoning=reasoning,
                      reasoning_tokens=reasoning_tokens(generated, answer, req.params),
                      token_logprobs=draw and draw.token_logprobs,
                      top_logprobs=draw and draw.top_logprobs and with_tokens(self.tokenizer, draw.top_logprobs))


def logged_logprobs(raw: torch.Tensor, processed: torch.Tensor, reqs: list[Request], rows: list[int]
                    ) -> torch.Tensor:
    """The log-probabilities [len(rows), V] that `rows` (their requests `reqs`) record: the model's own (raw, before
    any processor, constraint or temperature: vLLM's raw_logprobs, what sampling.logprobs returns), but a scored
    choice's forced sequence's (SampleParams.forced) from the processed logits, the ones its label would be picked
    from: its score then counts logit_bias and the penalties, so that the scores and the answer agree."""
    scored = [i for i, r in enumerate(reqs) if r.params.forced and r.params.shapes_logits]
    if not scored or processed is raw:
        return torch.log_softmax(raw[rows].float(), dim=-1)
    source = raw[rows].float()  # a copy: [len(rows), V]
    at = torch.tensor(scored, device=source.device)
    source.index_copy_(0, at, processed[torch.tensor([rows[i] for i in scored], device=raw.device)].float())
    return torch.log_softmax(source, dim=-1)


def record_logprobs(logp: torch.Tensor, draws: list[Draw], tokens: list[int], ks: list[int]) -> None:
    """Append each row's picked token's log-probability and its top k ([token_id, logprob], likeliest first) to its
    Draw. logp: [rows, V], logged_logprobs' (the model's own, a scored choice's processed)."""
    picked = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    most = max(ks)
    top = torch.topk(logp, most, dim=-1) if most else None
    for j, (draw, k) in enumerate(zip(draws, ks)):
        draw.token_logprobs.append(picked[j])  # type: ignore[union-attr]
        pairs = [] if top is None else list(map(list, zip(top.indices[j, :k].tolist(), top.values[j, :k].tolist())))
        draw.top_logprobs.append(pairs)  # type: ignore[union-attr]


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a row: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
