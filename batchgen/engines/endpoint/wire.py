"""engine=openai's wire format: a Request as an OpenAI completions or chat request body, a response as a Result.

What the OpenAI API has (max_tokens, temperature, top_p, seed, stop, logprobs, response_format with a JSON schema)
goes as the API names it. With engine.extensions=vllm the body also carries vLLM's own fields: `structured_outputs`
for a regex, choice or grammar constraint (and for a schema, compact as the in-process engines write it), top_k,
ignore_eos, `return_token_ids` (the text is then decoded from the ids, as engine=vllm does) and
`return_tokens_as_token_ids` (logprobs keyed by token id). Without them those constraints and settings are refused
before anything is sent (unsupported()). Knows JSON bodies, not HTTP.
"""

from __future__ import annotations

from typing import Any, Optional

from batchgen.constraints import Constraint
from batchgen.engines.base import reasoning_tokens, split_answer
from batchgen.records import Request, Result
from batchgen.sampling import find_stop

VLLM_ONLY_KINDS = ("regex", "choice", "grammar")


def unsupported(extensions: str, constraint_kind: Optional[str], top_k: int, ignore_eos: bool,
                reasoning: bool) -> list[str]:
    """What a job asks that the endpoint cannot be sent without vLLM's extensions, as config problems."""
    if extensions == "vllm":
        return []
    out = []
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
         extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON body of one sample's request (n=1, its own seed)."""
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
        out.update(return_token_ids=True, skip_special_tokens=True)
        if p.top_k > 0:
            out["top_k"] = p.top_k
        if p.ignore_eos:
            out["ignore_eos"] = True
        if p.logprobs is not None:
            out["return_tokens_as_token_ids"] = True
    if p.constraint is not None:
        out.update(_constraint(p.constraint, vllm))
    return out | extra


def _constraint(c: Constraint, vllm: bool) -> dict[str, Any]:
    if vllm:  # as engine=vllm sends it: a schema without free whitespace
        spec: dict[str, Any] = ({"json": c.schema, "disable_any_whitespace": True} if c.kind == "json_schema" else
                                {"choice": c.choices} if c.kind == "choice" else {c.kind: c.spec})
        return {"structured_outputs": spec}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": c.schema, "strict": True}}}


def result(req: Request, data: dict[str, Any], chat: bool, tokenizer: Any) -> Result:
    """One response as the sample's Result. Where the server returned the generated token ids (vLLM's
    return_token_ids) the text is decoded from them in one piece and cut before the first stop string, exactly as
    engine=vllm does in-process; else the server's text is taken as it is."""
    choice = data["choices"][0]
    reason = choice.get("finish_reason")
    usage = data.get("usage") or {}
    ids = choice.get("token_ids")
    reasoning, answer = None, []
    if ids is not None:
        answer, reasoning = split_answer(tokenizer, list(ids), req.params)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        cut = find_stop(text, req.params.stop) if req.params.stop else -1
        text = text if cut < 0 else text[:cut]
    else:
        text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    prompt_tokens = usage.get("prompt_tokens", len(req.prompt_ids))
    generated = usage.get("completion_tokens", len(ids) if ids is not None else 0)
    if reason not in ("stop", "length") or not isinstance(text, str):
        return Result(key=req.key, text="", finish_reason="error", num_prompt_tokens=prompt_tokens,
                      num_generated_tokens=generated,
                      error=f"endpoint_finish: the endpoint ended the sample with finish_reason={reason!r}")
    details = usage.get("completion_tokens_details") or {}
    thought = details.get("reasoning_tokens")
    if thought is None and ids is not None:
        thought = reasoning_tokens(list(ids), answer, req.params)
    out = Result(key=req.key, text=text, finish_reason=reason, num_prompt_tokens=prompt_tokens,
                 num_generated_tokens=generated, reasoning=reasoning, reasoning_tokens=thought,
                 cached_prompt_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    if req.params.logprobs is not None:
        out.token_logprobs, out.top_logprobs = _logprobs(choice.get("logprobs") or {}, chat, req.params.logprobs,
                                                         tokenizer)
    return out


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
        picked.append(float(chosen))
        ranked = sorted((alternatives or {}).items(), key=lambda item: -item[1])[:k]
        top.append([[*_token(name, tokenizer), float(value)] for name, value in ranked])
    return picked, top


def _token(name: str, tokenizer: Any) -> tuple[int, str]:
    if name.startswith("token_id:") and name[9:].isdigit():
        token_id = int(name[9:])
        return token_id, tokenizer.decode([token_id])
    return -1, name


def error_result(req: Request, status: int, message: str) -> Result:
    """A request the server rejected (400, a context too long, 422): an error row of its own kind."""
    return Result(key=req.key, text="", finish_reason="error", num_prompt_tokens=len(req.prompt_ids),
                  num_generated_tokens=0, error=f"endpoint_rejected: HTTP {status}: {message[:500]}")
