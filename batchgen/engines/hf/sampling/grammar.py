"""Constrained decoding for the hf engine, through xgrammar (vLLM's default structured-output backend).

One GrammarCompiler per engine (its tokenizer, its EOS ids as the grammar's stop tokens); each constraint is
compiled once per job and cached; every constrained sequence has its own GrammarMatcher. Before a token is
picked, the matchers of the constrained rows fill one shared token bitmask and it is applied to those rows'
logits only, so constrained and free rows share a decode step and each gets what it would get alone. Knows
token ids and logits; the constraint's meaning is batchgen.constraints'.

Why xgrammar rather than llguidance: filling and applying 32 rows' masks for a JSON schema over a 32k vocabulary took
0.35 ms a step with xgrammar 0.2.8 and 1.76 ms with llguidance 1.7.6, side by side in one process on a 2-core AMD
EPYC Zen 4 (`benchmarks/constraints.py --backends`); xgrammar precomputes most of each state's mask when it
compiles. It is also what vLLM uses by default, so both engines constrain through the same library.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from batchgen.constraints import Constraint, grammar

COMPILED_KEPT = 256  # compiled grammars kept per engine


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]):
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()  # the last COMPILED_KEPT, least recent out
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def matcher(self, constraint: Constraint) -> Any:
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = self._compiled[constraint] = self.compiler.compile_grammar(grammar(constraint))
            if len(self._compiled) > COMPILED_KEPT:  # per-row choice lists: bounded, however many there are
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(constraint)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
        """`logits` [B, V] with every token the row's matcher forbids set to -inf (rows without a matcher, and
        rows whose matcher has terminated, untouched); float32, the dtype xgrammar's CPU kernel takes."""
        rows = [j for j, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return logits
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for j in rows:
            matchers[j].fill_next_token_bitmask(self._bitmask, j)
        logits = logits.float()
        bitmask = self._bitmask[: logits.shape[0]]
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
        return logits
