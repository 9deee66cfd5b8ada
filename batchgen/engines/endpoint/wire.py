"""engine=openai's wire format: a Request as an OpenAI completions or chat request body, a response as a Result.

What the OpenAI API has (max_tokens, temperature, top_p, seed, stop, logprobs, response_format with a JSON schema,
and where set presence_penalty, frequency_penalty, logit_bias) goes as the API names it. With engine.extensions=vllm
the body also carries vLLM's own fields: `structured_outputs` for a regex, choice or grammar constraint (and for a
schema, compact as the in-process engines write it), top_k, ignore_eos, repetition_penalty, min_p and min_tokens
(where set), `return_token_ids` (the text is then decoded from the ids, as engine=vllm does) and
`return_tokens_as_token_ids` (logprobs keyed by token id). Without them those constraints and settings are refused
before anything is sent (unsupported()). A request refused naming a sampling field it carried says which key set it
(error_result). Without a local tokenizer (engine.tokenizer unset, the chat endpoint) no token ids are asked for:
the text is the server's, the token counts its usage's (estimated from characters where it sends none). Knows JSON
bodies, not HTTP.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from batchgen.constraints import Constraint
from batchgen.engines.base import answer_text, estimate_tokens, reasoning_tokens, split_answer
from batchgen.records import Request, Result
from batchgen.sampling import DECODING, PROCESSOR_COLUMNS, PROCESSORS, SampleParams

VLLM_ONLY_KINDS = ("regex", "choice", "grammar")
OPENAI_PROCESSORS = ("presence_penalty", "frequency_penalty", "logit_bias")  # the OpenAI API's own fields
VLLM_PROCESSORS = ("repetition_penalty", "min_p", "min_tokens", "bad_words", "allowed_token_ids",
                   "stop_token_ids")  # vLLM's extra fields (engine.extensions=vllm)
VLLM_DECODING = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                 "truncate_prompt_tokens")  # vLLM's extra fields shaping the text and the prompt (sampling.DECODING)


def unsupported(extensions: str, constraint_kind: Optional[str], top_k: int, ignore_eos: bool,
                reasoning: bool, extras: tuple[str, ...] = ()) -> list[str]:
    """What a job asks that the endpoint cannot be sent without vLLM's extensions, as config problems. extras: the
    keys that set a VLLM_PROCESSORS or VLLM_DECODING field (sampling.min_p, dataset.min_p_column, ...)."""
    if extensions == "vllm":
        return []
    out = [f"{key}: not an OpenAI API setting; set engine.extensions=vllm for a vLLM server" for key in extras]
    if reasoning:
        out.append("sampling.reasoning: the reasoning is split from the generated token ids, which only a vLLM "
                   "server returns (engine.extensions=vllm); leave sampling.reasoning=off")
    if constraint_kind in VLLM_ONLY_KINDS:
        out.append(f"sampling.{constraint_kind}: an OpenAI endpoint takes only a JSON schema (response_format); "
                   f"set engine.extensions=vllm where the server is vLLM, or use sampling.json_schema")
    if top_k > 0:
        out.append("sampling.top_k: not an OpenAI API setting; set engine.extensions=vllm for a vLLM server")
    if ignore_eos:
        out.append("sampling.ignore_eos: not an OpenAI API setting; set engine.extensions=vllm for a vLLM server")
    return out


def body(req: Request, model: str, chat: bool, vllm: bool, messages: Optional[list[dict]],
         extra: dict[str, Any], *, token_ids: bool = True) -> dict[str, Any]:
    """The JSON body of one sample's request (n=1, its own seed). token_ids: whether vLLM's token ids are asked for
    (a local tokenizer decodes them); without, the server's text and token names are taken."""
    p = req.params
    out: dict[str, Any] = {"model": model, "max_tokens": p.max_new_tokens, "temperature": p.temperature,
                           "top_p": p.top_p, "n": 1}
    if chat:
        out["messages"] = messages
    else:
        out["prompt"] = req.prompt_ids  # the token ids batchgen rendered and fitted: the server does not re-tokenize
    if req.seed is not None:
        out["seed"] = req.seed
    if p.stop:
        out["stop"] = list(p.stop)
    if p.logprobs is not None:
        out.update({"logprobs": True, "top_logprobs": p.logprobs} if chat else {"logprobs": p.logprobs})
    if vllm:
        out.update({"return_token_ids": True} if token_ids else {}, skip_special_tokens=p.skip_special_tokens)
        out.update({key: getattr(p, key) for key in VLLM_DECODING if getattr(p, key) != DECODING[key]})
        if p.top_k > 0:
            out["top_k"] = p.top_k
        if p.ignore_eos:
            out["ignore_eos"] = True
        if p.logprobs is not None and token_ids:
            out["return_tokens_as_token_ids"] = True
    out.update(processor_fields(p, vllm))
    if p.constraint is not None:
        out.update(_constraint(p.constraint, vllm))
    return out | extra


def processor_fields(p: SampleParams, vllm: bool) -> dict[str, Any]:
    """The logits processors a sample sets (off ones are not sent): OpenAI's fields, and vLLM's with its extensions
    (unsupported() refuses them without). A logit_bias is keyed by token id as JSON text, as the API takes it."""
    names = OPENAI_PROCESSORS + (VLLM_PROCESSORS if vllm else ())
    out = {key: getattr(p, key) for key in names if getattr(p, key) != PROCESSORS[key]}
    if "logit_bias" in out:
        out["logit_bias"] = {str(token): bias for token, bias in p.logit_bias}
    return out


def _constraint(c: Constraint, vllm: bool) -> dict[str, Any]:
    if vllm:  # as engine=vllm sends it: a schema without free whitespace
        spec: dict[str, Any] = ({"json": c.schema, "disable_any_whitespace": True} if c.kind == "json_schema" else
                                {"choice": c.choices} if c.kind == "choice" else {c.kind: c.spec})
        return {"structured_outputs": spec}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": c.schema, "strict": True}}}


INT32_MAX = (1 << 31) - 1  # the output's count columns are int32


class Unreadable(ValueError):
    """An answer that does not say what the sample needs, or says it wrong (asked again, then the sample's error
    row names why): a server's answer is data to validate, like an input row."""


def result(req: Request, data: Any, chat: bool, tokenizer: Any) -> Result:
    """One response as the sample's Result. Where the server returned the generated token ids (vLLM's
    return_token_ids) the text is decoded from them in one piece and cut before the first stop string, exactly as
    engine=vllm does in-process; else (and always without a tokenizer) the server's text is taken as it is. A count
    the usage lacks is batchgen's own: the prompt's as planned (without a tokenizer, estimated from characters), the
    generated ids' (without a tokenizer, estimated from the text). Raises Unreadable where the answer is not one
    choice of index 0, a count is not a count or a token id is not the tokenizer's."""
    choice = _only_choice(data)
    reason = choice.get("finish_reason")
    usage = data.get("usage") or {}
    if not isinstance(usage, dict):
        raise Unreadable(f"usage is {type(usage).__name__}, not an object")
    ids = None if tokenizer is None else _token_ids(choice.get("token_ids"), len(tokenizer))
    reasoning, answer = None, []
    if ids is not None:
        answer, reasoning = split_answer(tokenizer, ids, req.params)
        text = answer_text(tokenizer, ids, answer, req.params)
    else:
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    prompt_tokens = count(usage, "prompt_tokens", len(req.prompt_ids))  # null or absent: batchgen's own count
    estimated = estimate_tokens(text) if tokenizer is None and isinstance(text, str) else 0
    generated = count(usage, "completion_tokens", len(ids) if ids is not None else estimated)
    if reason not in ("stop", "length") or not isinstance(text, str):
        return Result(key=req.key, text="", finish_reason="error", num_prompt_tokens=prompt_tokens,
                      num_generated_tokens=generated,
                      error=f"endpoint_finish: the endpoint ended the sample with finish_reason={reason!r}")
    details = _object(usage, "completion_tokens_details")
    thought = count(details, "reasoning_tokens", None)
    if thought is None and ids is not None:
        thought = reasoning_tokens(ids, answer, req.params)
    out = Result(key=req.key, text=text, finish_reason=reason, num_prompt_tokens=prompt_tokens,
                 num_generated_tokens=generated, reasoning=reasoning, reasoning_tokens=thought,
                 cached_prompt_tokens=count(_object(usage, "prompt_tokens_details"), "cached_tokens", None))
    if req.params.logprobs is not None:
        out.token_logprobs, out.top_logprobs = _logprobs(choice.get("logprobs") or {}, chat, req.params.logprobs,
                                                         tokenizer)
    return out


def counted(data: Any) -> bool:
    """Whether an answer's usage gives both token counts (else batchgen's own stand in for them)."""
    usage = data.get("usage") if isinstance(data, dict) else None
    return isinstance(usage, dict) and all(usage.get(k) is not None for k in ("prompt_tokens", "completion_tokens"))


def _only_choice(data: Any) -> dict[str, Any]:
    """The answer's one choice (batchgen asks n=1): exactly one, of index 0 (or none said)."""
    if not isinstance(data, dict):
        raise Unreadable(f"the body is {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        said = f"{len(choices)} choices" if isinstance(choices, list) else f"choices={short(choices)}"
        raise Unreadable(f"{said} for a request of n=1")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise Unreadable(f"the choice is {short(choice)}, not an object")
    if choice.get("index", 0) != 0 or isinstance(choice.get("index"), bool):
        raise Unreadable(f"a choice of index {short(choice.get('index'))} for a request of n=1 (index 0)")
    return choice


def _token_ids(ids: Any, vocab: int) -> Optional[list[int]]:
    """The choice's generated token ids, each one of the tokenizer's `vocab` ids; None where it sent none."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise Unreadable(f"token_ids={short(ids)} is not a list")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise Unreadable(f"token id {short(token)} is not one of the tokenizer's {vocab} ids (engine.tokenizer "
                             f"must be the served model's)")
    return ids


def count(usage: dict[str, Any], key: str, default: Optional[int]) -> Optional[int]:
    """usage[key] as a token count: `default` where it is absent or null (several gateways send null usage), else
    a non-negative int that fits the output's int32 column."""
    value = usage.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise Unreadable(f"usage {key}={short(value)} is not a token count (an integer from 0 to {INT32_MAX})")
    return value


def _object(usage: dict[str, Any], key: str) -> dict[str, Any]:
    value = usage.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Unreadable(f"usage {key}={short(value)} is not an object")
    return value


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _logprobs(lp: dict[str, Any], chat: bool, k: int, tokenizer: Any) -> tuple[list[float], list[list[list]]]:
    """The response's logprobs as batchgen's token_logprobs and top_logprobs ([token_id, token, logprob] triples,
    likeliest first). Tokens the server named by id ("token_id:N") are decoded; a token named by its text keeps it,
    with id -1 (an OpenAI endpoint does not say the id)."""
    if chat:
        positions = [(p["logprob"], {t["token"]: t["logprob"] for t in p.get("top_logprobs") or []})
                     for p in lp.get("content") or []]
    else:
        positions = list(zip(lp.get("token_logprobs") or [], lp.get("top_logprobs") or []))
    picked, top = [], []
    for chosen, alternatives in positions:
        picked.append(_logprob(chosen))
        ranked = sorted((alternatives or {}).items(), key=lambda item: -_logprob(item[1]))[:k]
        top.append([[*_token(name, tokenizer), _logprob(value)] for name, value in ranked])
    return picked, top


def _logprob(value: Any) -> float:
    """A log-probability as the server said it: a number, at most 0 (a rounding's hair above passes), or -inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-3:
        raise Unreadable(f"logprob {short(value)} is not a log-probability")
    return float(value)


def _token(name: Any, tokenizer: Any) -> tuple[int, str]:
    if not isinstance(name, str):
        raise Unreadable(f"a top_logprobs token {short(name)} is not a string")
    if name.startswith("token_id:") and name[9:].isdigit() and tokenizer is not None:
        token_id = int(name[9:])
        if token_id >= len(tokenizer):
            raise Unreadable(f"token id {token_id} in logprobs is not one of the tokenizer's {len(tokenizer)} ids")
        return token_id, tokenizer.decode([token_id])
    return -1, name


def error_result(req: Request, status: int, message: str, sent: Optional[dict[str, Any]] = None) -> Result:
    """A request the server rejected (400, a context too long, 422): an error row of its own kind. Where the message
    names a logits processor field the body `sent`, the error says so first, with the keys that set it."""
    refused = [key for key in (*OPENAI_PROCESSORS, *VLLM_PROCESSORS) if key in (sent or {}) and key in message]
    said = "".join(f"the server refused {key} (sampling.{key} / dataset.{PROCESSOR_COLUMNS[key]}): "
                   for key in refused)
    return Result(key=req.key, text="", finish_reason="error", num_prompt_tokens=len(req.prompt_ids),
                  num_generated_tokens=0, error=f"endpoint_rejected: HTTP {status}: {said}{message[:500]}")
