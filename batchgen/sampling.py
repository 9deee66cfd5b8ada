"""Sampling settings (structured-output constraints among them) and per-sample seeds; knows nothing about torch
or engines."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

from batchgen.constraints import Constraint, from_sampling


@dataclass
class SamplingConfig:
    max_new_tokens: int = 256  # cap on generated tokens per sample
    temperature: float = 0.0  # 0.0 means greedy
    top_p: float = 1.0  # nucleus mass kept; 1.0 = off
    top_k: int = 0  # tokens kept; 0 = off
    n: int = 1  # samples per prompt
    seed: int = 0  # job seed; each sample's seed derives from (seed, row id, sample index)
    stop: list[str] = field(default_factory=list)  # stop strings; the generation is cut before the first match
    ignore_eos: bool = False  # keep generating past EOS up to the cap
    # structured outputs, one at a time (constraints.py): checked before the model loads, every output validated
    json_schema: Optional[Any] = None  # a JSON schema: an inline mapping, or the path of a .json file
    regex: Optional[str] = None  # the whole generation matches this regular expression
    choice: Optional[list[str]] = None  # the generation is exactly one of these strings
    grammar: Optional[str] = None  # an EBNF grammar (xgrammar's dialect, as vLLM takes), inline or a .ebnf file
    choice_scores: bool = False  # with sampling.choice: a choice_scores column, each choice's probability
    schemas: dict[str, Any] = field(default_factory=dict)  # named JSON schemas for dataset.schema_column
    logprobs: Optional[int] = None  # k: token_logprobs (each generated token's) and top_logprobs (the k likeliest)
    # reasoning models: off | split (every sample thinks first: the text up to reasoning_end goes to a `reasoning`
    # column, a constraint applies after it) | auto (split where the prompt opens a reasoning block, as the chat
    # templates of reasoning models do; off elsewhere)
    reasoning: str = "off"
    reasoning_start: str = "<think>"
    reasoning_end: str = "</think>"
    max_reasoning_tokens: Optional[int] = None  # past this many thinking tokens, reasoning_end is forced
    # beam search: num_beams > 1 searches that many beams per row; its best n hypotheses are the samples, best first
    num_beams: int = 1
    length_penalty: float = 1.0  # a finished hypothesis scores sum(logprobs) / length ** length_penalty
    early_stopping: Any = False  # false (transformers' heuristic), true (once num_beams are finished), "never"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"sampling.max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            out.append(f"sampling.temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            out.append(f"sampling.top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            out.append(f"sampling.top_k must be >= 0, 0 = off (got {self.top_k})")
        if self.n < 1:
            out.append(f"sampling.n must be >= 1 (got {self.n})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            out.append("sampling.stop must be a list of non-empty strings")
        return out + self._annotation_problems()

    def _annotation_problems(self) -> list[str]:
        """Structured outputs, label scores, logprobs and reasoning."""
        constraint, out = from_sampling(self)
        if constraint is not None and self.ignore_eos:
            out.append(f"sampling.ignore_eos=true cannot go with sampling.{constraint.kind}: a constrained sample "
                       f"ends when its constraint is complete")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            out.append(f"sampling.logprobs must be null or 0..20 (top tokens kept per position; got {self.logprobs})")
        if self.reasoning not in REASONING:
            out.append(f"sampling.reasoning must be one of {', '.join(REASONING)} (got {self.reasoning!r})")
        elif self.reasoning != "off" and (not self.reasoning_start or not self.reasoning_end):
            out.append("sampling.reasoning_start and sampling.reasoning_end must be non-empty markers")
        if self.max_reasoning_tokens is not None and (self.max_reasoning_tokens < 1 or self.reasoning == "off"):
            out.append(f"sampling.max_reasoning_tokens must be >= 1 and needs sampling.reasoning=split or auto "
                       f"(got {self.max_reasoning_tokens}, reasoning={self.reasoning})")
        out += self._beam_problems(constraint)
        for name, schema in self.schemas.items():
            out += [p.replace("sampling.json_schema", f"sampling.schemas.{name}")
                    for p in from_sampling(SamplingConfig(json_schema=schema))[1]]
        return out

    def _beam_problems(self, constraint: Optional[Constraint]) -> list[str]:
        if self.num_beams < 1:
            return [f"sampling.num_beams must be >= 1 (got {self.num_beams}); 1 = no beam search"]
        if self.early_stopping not in (True, False, "never"):
            return [f"sampling.early_stopping must be true, false or never (got {self.early_stopping!r})"]
        if self.num_beams == 1:
            return []
        out = []
        if self.n > self.num_beams:
            out.append(f"sampling.n={self.n} > sampling.num_beams={self.num_beams}: beam search returns at most "
                       f"num_beams hypotheses per row")
        if self.temperature != 0.0:
            out.append("sampling.num_beams > 1 is deterministic beam search: set sampling.temperature=0 (beam "
                       "sampling is not supported)")
        taken = [k for k, v in (("a constraint", constraint), ("sampling.choice_scores", self.choice_scores),
                                ("sampling.logprobs", self.logprobs is not None), ("sampling.stop", self.stop),
                                ("sampling.reasoning", self.reasoning != "off")) if v]
        if taken:
            out.append(f"sampling.num_beams > 1 cannot go with {', '.join(taken)}")
        return out

    def constraint(self) -> Optional[Constraint]:
        """The constraint, built (a schema file read); call after problems() found none."""
        return from_sampling(self)[0]

    def named_schemas(self) -> dict[str, Constraint]:
        """sampling.schemas built, by name (call after problems() found none)."""
        return {name: from_sampling(SamplingConfig(json_schema=schema))[0] for name, schema in self.schemas.items()}


REASONING = ("off", "split", "auto")


@dataclass(slots=True, frozen=True)
class Reasoning:
    """A sample that thinks first: its reasoning ends with `end_ids` (sampling.reasoning_end as tokens); the text
    before them is its reasoning, the text after them its answer, and a constraint applies to the answer only."""

    end_ids: tuple[int, ...]
    start: str  # sampling.reasoning_start: dropped from the reasoning text
    max_tokens: Optional[int] = None  # past this many tokens still thinking, end_ids are forced


@dataclass(slots=True, frozen=True)
class SampleParams:
    """What one engine request needs to sample; a view of SamplingConfig plus the row's own cap."""

    max_new_tokens: int  # this sample's cap (row override applied)
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    ignore_eos: bool
    constraint: Optional[Constraint] = None  # structured output: what the text must be (constraints.py)
    choice_scores: bool = False  # also score every choice of a `choice` constraint (sampling.choice_scores)
    logprobs: Optional[int] = None  # return each generated token's log-probability and the top k (sampling.logprobs)
    reasoning: Optional[Reasoning] = None  # this sample thinks first (sampling.reasoning)
    forced: tuple[int, ...] = ()  # tokens fed in instead of sampled, one per step (a choice being scored)
    num_beams: int = 1  # beam search (sampling.num_beams): this request is hypothesis `beam_rank` of `beam_count`
    length_penalty: float = 1.0
    early_stopping: Any = False
    beam_rank: int = 0
    beam_count: int = 1
    score_from: Optional[int] = None  # task=loglik: no generation; the prompt's tokens from here on are scored
    pooling: Optional[str] = None  # task=embed: no generation; the prompt's final hidden states pooled (mean, last)
    normalize: bool = False  # task=embed: the pooled state scaled to unit length
    shared: int = 0  # task=decide: the first `shared` tokens are the row's prompt, prefilled once for its questions

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def derive_seed(job_seed: int, row_id: str, sample_index: int) -> int:
    """A 63-bit seed that depends only on (job seed, row id, sample index), never on batching or sharding."""
    digest = hashlib.blake2b(f"{job_seed}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest match of any stop string in `text`, or -1; the generation is cut there."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def split_reasoning(ids: list[int], reasoning: Reasoning) -> Optional[int]:
    """Where the answer starts in a thinking sample's generated ids: just after the first complete end marker; None
    while (or when) it never ends its reasoning."""
    end, n = reasoning.end_ids, len(reasoning.end_ids)
    for i in range(len(ids) - n + 1):
        if tuple(ids[i:i + n]) == end:
            return i + n
    return None
