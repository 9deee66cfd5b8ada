"""Sampling settings (structured-output constraints among them) and per-sample seeds; knows nothing about torch
or engines."""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Mapping
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
    # logits processors as HF generate and vLLM's SamplingParams apply them, each off at its default (PROCESSORS)
    repetition_penalty: float = 1.0  # > 0: a prompt or generated token's logit divided by it (multiplied if < 0)
    presence_penalty: float = 0.0  # -2..2: subtracted from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # -2..2: times the token's count in the generation, subtracted from its logit
    min_p: float = 0.0  # 0..1: after temperature, tokens below min_p times the likeliest's probability are dropped
    min_tokens: int = 0  # EOS and stop strings are ignored until this many tokens were generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    bad_words: list[str] = field(default_factory=list)  # never generated: each word's tokens as vLLM finds them
    allowed_token_ids: list[int] = field(default_factory=list)  # only these tokens are generated; [] = every token
    stop_token_ids: list[int] = field(default_factory=list)  # a generated token among these ends the sample ("stop")
    # the text and the prompt, as vLLM's SamplingParams shape them (DECODING: each off at its default)
    include_stop_str_in_output: bool = False  # the text keeps the stop string it is cut at
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers) dropped from the text
    spaces_between_special_tokens: bool = True  # a space between special tokens in the text (slow tokenizers only)
    truncate_prompt_tokens: Optional[int] = None  # k: only the prompt's last k tokens are given to the model
    prompt_logprobs: Optional[int] = None  # vLLM's per-token prompt log-probabilities: not supported yet (null)

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
        out += [f"sampling.{key} {problem}" for key in PROCESSORS
                if (problem := processor_value(key, getattr(self, key))[1])]
        out += self._decoding_problems()
        if isinstance(self.min_tokens, int) and self.min_tokens > self.max_new_tokens:
            out.append(f"sampling.min_tokens={self.min_tokens} must be <= sampling.max_new_tokens "
                       f"({self.max_new_tokens})")
        return out + self._annotation_problems()

    def processors(self) -> dict[str, Any]:
        """The logits processors' settings as SampleParams takes them (call after problems() found none)."""
        return {key: processor_value(key, getattr(self, key))[0] for key in PROCESSORS}

    def _decoding_problems(self) -> list[str]:
        """The DECODING keys: switches, a prompt cut and a prompt logprobs' k."""
        out = [f"sampling.{key} must be true or false (got {getattr(self, key)!r})" for key, off in DECODING.items()
               if isinstance(off, bool) and not isinstance(getattr(self, key), bool)]
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            out.append(f"sampling.truncate_prompt_tokens must be null or an integer >= 1, the prompt tokens kept "
                       f"(got {k!r}; vLLM's -1, the model's length, is run.too_long=truncate_left)")
        if self.prompt_logprobs is not None:
            out.append(f"sampling.prompt_logprobs={self.prompt_logprobs!r}: per-token prompt log-probabilities are "
                       f"not supported yet; leave it null (task=loglik scores a text's tokens after a prompt, summed)")
        if self.allowed_token_ids and from_sampling(self)[0] is not None:
            out.append("sampling.allowed_token_ids cannot go with a constraint: the constraint chooses the tokens")
        return out

    def decoding(self) -> dict[str, Any]:
        """The DECODING keys' settings, as SampleParams takes them."""
        return {key: getattr(self, key) for key in DECODING}

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
                                ("sampling.reasoning", self.reasoning != "off"),
                                ("sampling.prompt_logprobs", self.prompt_logprobs is not None),
                                *((f"sampling.{k}", v != PROCESSORS[k]) for k, v in self.processors().items())) if v]
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
# the logits processors' keys (sampling.KEY, dataset.KEY_column, SampleParams.KEY) and the value that turns each off
PROCESSORS: dict[str, Any] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                              "min_p": 0.0, "min_tokens": 0, "logit_bias": (), "bad_words": (),
                              "allowed_token_ids": (), "stop_token_ids": ()}
# the dataset.* key of each one's per-row column
PROCESSOR_COLUMNS = {"repetition_penalty": "repetition_penalty_column", "presence_penalty": "presence_penalty_column",
                     "frequency_penalty": "frequency_penalty_column", "min_p": "min_p_column",
                     "min_tokens": "min_tokens_column", "logit_bias": "logit_bias_column",
                     "bad_words": "bad_words_column", "allowed_token_ids": "allowed_token_ids_column",
                     "stop_token_ids": "stop_token_ids_column"}
TOKEN_LISTS = ("allowed_token_ids", "stop_token_ids")  # the PROCESSORS keys that hold token ids, ascending
# the keys that shape the text and the prompt (sampling.KEY, SampleParams.KEY) and the value that turns each off
DECODING: dict[str, Any] = {"include_stop_str_in_output": False, "skip_special_tokens": True,
                            "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
                            "prompt_logprobs": None}
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias (vLLM clamps to it)


def processor_value(key: str, value: Any) -> tuple[Any, Optional[str]]:
    """A logits processor's setting (PROCESSORS) as SampleParams holds it, or why it is not one (a phrase that
    follows the key's name): a number in the key's range, a whole number for min_tokens, and for logit_bias a
    mapping of token ids (ints, or ASCII digit strings as JSON writes them) to biases, held as sorted (id, bias)
    pairs."""
    if key == "logit_bias":
        return _logit_bias(value)
    if key in TOKEN_LISTS:
        return _token_list(value)
    if key == "bad_words":
        words = value if isinstance(value, (list, tuple)) else None
        if words is None or not all(isinstance(w, str) and w.strip() for w in words):
            return None, f"must be a list of words, each with a character other than a space (got {value!r:.80})"
        return tuple(dict.fromkeys(words)), None
    if isinstance(value, float) and key == "min_tokens" and value.is_integer():
        value = int(value)  # pandas' float64 for an int column with NaN
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and abs(value) <= sys.float_info.max
    if key == "min_tokens":
        ok, want = number and isinstance(value, int) and value >= 0, "an integer >= 0"
    elif key == "repetition_penalty":
        ok, want = number and value > 0, "a number > 0 (1 = off)"
    elif key == "min_p":
        ok, want = number and 0 <= value <= 1, "a number in [0, 1] (0 = off)"
    else:
        ok, want = number and -2 <= value <= 2, "a number in [-2, 2] (0 = off)"
    return (value if key == "min_tokens" else float(value), None) if ok else (None, f"must be {want} (got {value!r})")


def _logit_bias(value: Any) -> tuple[Any, Optional[str]]:
    """A logit_bias mapping (or an Arrow map's pairs; nulls dropped: _bias_pairs), read strictly: each key a token
    id (token_id), no token id twice (1, "01" and "001" are one token: its biases would add up past the bound), each
    bias a number in [-100, 100]."""
    pairs = _bias_pairs(value)
    if pairs is None:
        return None, f"must be a mapping of token ids to biases (got {value!r})"
    biases: dict[int, float] = {}
    for key, bias in pairs:
        token = token_id(key)
        if token is None:
            return None, f"has {key!r}, which is not a token id (an integer >= 0, or its ASCII digits)"
        if token in biases:
            return None, f"gives token {token} two biases (key {key!r} spells it again); give each token id once"
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            return None, f"gives token {token} the bias {bias!r:.40}, not a number in [-100, 100]"
        biases[token] = float(bias)
    return tuple(sorted(biases.items())), None


def _token_list(value: Any) -> tuple[Any, Optional[str]]:
    """A list of token ids (ints, or their ASCII digits), held as a sorted tuple without repeats."""
    tokens = [token_id(v) for v in value] if isinstance(value, (list, tuple)) else [None]
    if None in tokens:
        return None, f"must be a list of token ids, each an integer >= 0 (got {value!r:.80})"
    return tuple(sorted(set(tokens))), None  # type: ignore[type-var]


def _bias_pairs(value: Any) -> Optional[list[tuple[Any, Any]]]:
    """The (key, bias) pairs of a mapping, or of a list of pairs (an Arrow map column's value), a null bias dropped
    (a struct column's field that another row has: JSONL objects with different keys read as one struct); None for
    anything else."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        pairs = value
    else:
        return None
    return [(key, bias) for key, bias in pairs if bias is not None]


TOKEN_ID_TEXT = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also takes "²" and "٣"


def token_id(key: Any) -> Optional[int]:
    """A token id as a mapping's key holds it: an int >= 0, or its ASCII decimal digits (JSON's string keys); None for
    anything else (a bool, a float, a sign, a space, other scripts' digits)."""
    if isinstance(key, str):
        return int(key) if TOKEN_ID_TEXT.fullmatch(key) else None
    return key if isinstance(key, int) and not isinstance(key, bool) and key >= 0 else None


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
    # task=decide: each of the row's answers as its tokens after `shared`, in plan order; the engine prefills the row's
    # whole set as one batch whatever part of it is asked (a resumed row's scores as an uninterrupted run's)
    answers: tuple[tuple[int, ...], ...] = ()
    # logits processors (sampling.KEY, or the row's dataset.KEY_column), each off at its PROCESSORS value
    repetition_penalty: float = 1.0  # HF's, over the prompt's and the generated tokens
    presence_penalty: float = 0.0  # OpenAI's and vLLM's, over the generated tokens only
    frequency_penalty: float = 0.0  # the same, times each token's count
    min_p: float = 0.0  # applied after temperature, top-k and top-p, as HF's MinPLogitsWarper
    min_tokens: int = 0  # EOS masked, stop strings ignored, until this many tokens were generated (<= the cap)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids ascending
    bad_words: tuple[str, ...] = ()  # words never generated (vLLM's bad_words: the engine tokenizes them)
    allowed_token_ids: tuple[int, ...] = ()  # only these are generated; () = every token
    stop_token_ids: tuple[int, ...] = ()  # generating one ends the sample ("stop"; the token kept in its ids)
    # the text and the prompt (DECODING), each off at its default
    include_stop_str_in_output: bool = False  # the text keeps the stop string it was cut at
    skip_special_tokens: bool = True  # special tokens dropped from the text
    spaces_between_special_tokens: bool = True  # a space between special tokens (slow tokenizers' decode only)
    truncate_prompt_tokens: Optional[int] = None  # the prompt ids were cut to their last k (the planner's)
    prompt_logprobs: Optional[int] = None  # k: each prompt token's log-probability and the top k per position

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether a penalty, a logit bias or min_tokens changes this sample's logits before any token choice
        (min_p does not: it only filters what sampling draws from)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0 or bool(self.logit_bias) or bool(self.bad_words)
                or bool(self.allowed_token_ids))


def derive_seed(job_seed: int, row_id: str, sample_index: int) -> int:
    """A 63-bit seed that depends only on (job seed, row id, sample index), never on batching or sharding."""
    digest = hashlib.blake2b(f"{job_seed}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def find_stop(text: str, stops: tuple[str, ...], after: int = 0) -> int:
    """Index of the earliest match of any stop string in `text` that ends past its first `after` characters (the
    text of the sample's first min_tokens tokens, in which a stop string does not count), or -1; the generation is
    cut there."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def split_reasoning(ids: list[int], reasoning: Reasoning) -> Optional[int]:
    """Where the answer starts in a thinking sample's generated ids: just after the first complete end marker; None
    while (or when) it never ends its reasoning."""
    end, n = reasoning.end_ids, len(reasoning.end_ids)
    for i in range(len(ids) - n + 1):
        if tuple(ids[i:i + n]) == end:
            return i + n
    return None
