"""The hf engine's logits processors, applied to a step's logits before any token is chosen: logit_bias, min_tokens
(EOS masked), the repetition penalty (HF's, over the prompt's and the generated tokens), then the presence and
frequency penalties (OpenAI's and vLLM's, over the generated tokens only). That is vLLM's order and HF generate's
(sequence_bias, repetition_penalty, min_new_tokens: a masked EOS stays masked under any penalty). min_p is not here:
it only filters what a sampled row draws from (draw.py).

The rows that have any are processed together, in float32, as HF generate's processors see its scores; the other
rows keep their logits as they are and cost the caller one scan of a list. Greedy and sampled rows then choose from
the processed logits. Knows token ids, SampleParams and tensors; nothing about
models, caches or requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from batchgen.sampling import SampleParams


@dataclass(slots=True)
class History:
    """What a sample's penalties remember of its tokens, on the logits' device; made at its first step."""

    in_context: Optional[torch.Tensor]  # [V] bool: in the prompt or generated (repetition_penalty); None: off
    counts: Optional[torch.Tensor]  # [V] float32: times generated (presence and frequency penalties); None: off
    bad: tuple[tuple[int, ...], ...] = ()  # bad_words as token sequences (Sampler.bad_words)
    generated: Optional[list[int]] = None  # its generated tokens, where a bad word has several tokens

    @classmethod
    def start(cls, params: SampleParams, prompt_ids: list[int], vocab: int, device: torch.device,
              bad: tuple[tuple[int, ...], ...] = ()) -> History:
        in_context = counts = None
        if params.repetition_penalty != 1.0:
            in_context = torch.zeros(vocab, dtype=torch.bool, device=device)
            in_context[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        return cls(in_context, counts, bad, [] if any(len(b) > 1 for b in bad) else None)

    def take(self, token: int) -> None:
        """The sample generated `token` (no host sync: a write at a host index)."""
        if self.in_context is not None:
            self.in_context[token] = True
        if self.counts is not None:
            self.counts[token] += 1
        if self.generated is not None:
            self.generated.append(token)

    def banned(self) -> list[int]:
        """The tokens its bad words forbid now (vLLM's rule): a word's last token where the tokens before it end the
        generation (its own tokens only, not the prompt's)."""
        done = self.generated or []
        return [b[-1] for b in self.bad
                if len(b) == 1 or len(done) >= len(b) - 1 and tuple(done[1 - len(b):]) == b[:-1]]


def apply(logits: torch.Tensor, rows: list[int], params: list[SampleParams], histories: list[History],
          generated: list[int], eos_ids: list[int]) -> torch.Tensor:
    """logits [B, V] with the processors of `rows` applied: float32, a new tensor, the other rows' values as they
    were. params, histories and generated (tokens generated so far) hold one entry per row of `rows`."""
    index = torch.tensor(rows, device=logits.device)
    x = logits.index_select(0, index).float()  # [R, V], a copy
    add_bias(x, params)
    mask_eos(x, params, generated, [t for t in eos_ids if t < x.shape[-1]])
    ban_words(x, histories)
    allow_only(x, params)
    x = penalise_repetition(x, params, histories)
    x = penalise_presence_frequency(x, params, histories)
    if len(rows) == logits.shape[0]:
        return x  # every row processed, in order
    out = logits.float()
    out = out.clone() if out is logits else out
    return out.index_copy_(0, index, x)


def add_bias(x: torch.Tensor, params: list[SampleParams]) -> None:
    """logit_bias: each (token id, bias) pair added to its row's logit (OpenAI's; HF's sequence_bias of one token)."""
    pairs = [(i, token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    if pairs:
        row, token, bias = zip(*pairs)
        at = (torch.tensor(row, device=x.device), torch.tensor(token, device=x.device))
        x.index_put_(at, torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


def mask_eos(x: torch.Tensor, params: list[SampleParams], generated: list[int], eos_ids: list[int]) -> None:
    """min_tokens: EOS and the row's stop_token_ids are -inf in a row that generated fewer tokens than its min_tokens
    (HF's MinNewTokensLength processor over its eos_token_id list, vLLM's min_tokens)."""
    for i, (p, n) in enumerate(zip(params, generated)):
        ids = [t for t in (*eos_ids, *p.stop_token_ids) if t < x.shape[-1]]
        if n < p.min_tokens and ids:
            x[i, torch.tensor(ids, device=x.device)] = float("-inf")


def ban_words(x: torch.Tensor, histories: list[History]) -> None:
    """bad_words: the tokens each row's words forbid now are -inf (vLLM's bad words processor, HF's
    NoBadWordsLogitsProcessor over the generated tokens)."""
    for i, h in enumerate(histories):
        if h.bad and (banned := [t for t in h.banned() if t < x.shape[-1]]):
            x[i, torch.tensor(banned, device=x.device)] = float("-inf")


def allow_only(x: torch.Tensor, params: list[SampleParams]) -> None:
    """allowed_token_ids: every other token is -inf (vLLM's allowed_token_ids, HF's prefix_allowed_tokens_fn)."""
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            keep = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
            keep[torch.tensor([t for t in p.allowed_token_ids if t < x.shape[-1]], device=x.device)] = True
            x[i].masked_fill_(~keep, float("-inf"))


def penalise_repetition(x: torch.Tensor, params: list[SampleParams], histories: list[History]) -> torch.Tensor:
    """repetition_penalty: a token in the prompt or the generation has its logit divided by the penalty where it is
    positive, multiplied where negative (HF's RepetitionPenaltyLogitsProcessor, vLLM's repetition_penalty)."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return x
    seen = torch.stack([histories[i].in_context for i in rows])  # type: ignore[misc]  # [r, V]
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=x.device)[:, None]
    return on_rows(x, rows, lambda sub: torch.where(seen, torch.where(sub < 0, sub * penalty, sub / penalty), sub))


def penalise_presence_frequency(x: torch.Tensor, params: list[SampleParams], histories: list[History]
                                ) -> torch.Tensor:
    """presence_penalty once for every token generated at least once, frequency_penalty once per time it was
    generated, both subtracted from its logit (OpenAI's and vLLM's; the prompt does not count)."""
    rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rows:
        return x
    counts = torch.stack([histories[i].counts for i in rows])  # type: ignore[misc]  # [r, V]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=x.device)[:, None]
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=x.device)[:, None]
    return on_rows(x, rows, lambda sub: sub - frequency * counts - presence * (counts > 0))


def on_rows(x: torch.Tensor, rows: list[int], change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [n, V] with its `rows` replaced by change(those rows) [r, V]: in place where some rows are left out, and
    no gather nor scatter where every row is in."""
    if len(rows) == x.shape[0]:
        return change(x)
    index = torch.tensor(rows, device=x.device)
    return x.index_copy_(0, index, change(x.index_select(0, index)))
