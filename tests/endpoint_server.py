"""A small OpenAI-compatible server for the endpoint tests: a real model (transformers' generate on a local model
directory, one request at a time) behind /v1/models, /v1/completions and /v1/chat/completions, with faults injected
on purpose: 429 with Retry-After, 503, slow answers, connections dropped mid-request, and 400 for prompts holding
the word REJECT, and for a prompt holding `REFUSE:FIELD` that carries the body field FIELD (as OpenAI refuses a
parameter a model does not take); a prompt holding `ECHO:STATUS` is answered STATUS with an error message that
quotes the request's path and query, its Authorization header and its body (as a careless gateway does). The logits
processor fields (OpenAI's presence_penalty, frequency_penalty, logit_bias; vLLM's repetition_penalty, min_p,
min_tokens) are applied as HF generate's processors. Faults are drawn from a seeded generator per request, so a
run's faults repeat. A server that lies: the answer to a prompt holding `MANGLE:KIND` is changed as mangle() says
for KIND (a usage that is null, a string, too large or negative; two choices, the wrong one first; a choice of
another index; a token id outside the vocabulary), and /v1/models answers as --models says (a model list, or a web
page, a list, a list of strings, a max_model_len that is not a number).

    python -m tests.endpoint_server --model DIR [--faults 429=0.1,503=0.05,slow=0.05,drop=0.05]
        [--fault-requests N] [--log FILE] [--name SERVED_NAME] [--models KIND]

prints `port N` once listening on 127.0.0.1. The log gets one JSON line per request: what was asked (the body's
digest, its prompt or messages, its logits processor fields) and what was answered (status, or the fault)."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_p", "min_tokens",
                    "bad_words", "allowed_token_ids", "stop_token_ids", "include_stop_str_in_output",
                    "truncate_prompt_tokens")


class OpenAIPenalties:
    """presence_penalty and frequency_penalty as OpenAI defines them, over the generated tokens only: HF generate
    has no such processor, so it runs after its own (repetition_penalty among them), as vLLM's order has it."""

    def __init__(self, presence: float, frequency: float, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def processor_kwargs(body: dict[str, Any], prompt_len: int, tok: Any = None) -> dict[str, Any]:
    """The body's logits processor fields as HF generate's keywords (vLLM's stop_token_ids as eos_token_id's list,
    allowed_token_ids as prefix_allowed_tokens_fn, bad_words as bad_words_ids tokenized as vLLM does)."""
    out: dict[str, Any] = {"repetition_penalty": body.get("repetition_penalty"), "min_p": body.get("min_p"),
                           "min_new_tokens": body.get("min_tokens")}
    if body.get("stop_token_ids"):
        out["eos_token_id"] = [tok.eos_token_id, *body["stop_token_ids"]]
    if body.get("allowed_token_ids"):
        out["prefix_allowed_tokens_fn"] = lambda batch, ids: list(body["allowed_token_ids"])
    if body.get("bad_words"):
        out["bad_words_ids"] = []
        for word in body["bad_words"]:  # vLLM's SamplingParams.update_from_tokenizer
            alone, spaced = (tok.encode(p + word.lstrip(), add_special_tokens=False) for p in ("", " "))
            out["bad_words_ids"] += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    if body.get("logit_bias"):
        out["sequence_bias"] = {(int(token),): float(bias) for token, bias in body["logit_bias"].items()}
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        out["logits_processor"] = LogitsProcessorList([OpenAIPenalties(
            float(body.get("presence_penalty") or 0), float(body.get("frequency_penalty") or 0), prompt_len)])
    return {key: value for key, value in out.items() if value is not None}


class Backend:
    def __init__(self, model_dir: str, name: str):
        self.name = name
        self.model_dir = model_dir  # the served model's root, as vLLM reports the path it loaded
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lock = threading.Lock()
        self.max_model_len = self.model.config.max_position_embeddings

    def complete(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        tok = self.tokenizer
        if chat:
            text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            prompt = body["prompt"]
            ids = list(prompt) if isinstance(prompt, list) else tok(prompt)["input_ids"]
        if len(ids) + body.get("max_tokens", 16) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens")
        temperature = float(body.get("temperature", 1.0))
        with self.lock, torch.no_grad():
            if body.get("seed") is not None:
                torch.manual_seed(int(body["seed"]) % (1 << 63))
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=body.get("max_tokens", 16), do_sample=temperature > 0,
                                      temperature=temperature if temperature > 0 else None,
                                      top_p=body.get("top_p", 1.0) if temperature > 0 else None, top_k=None,
                                      pad_token_id=tok.eos_token_id, output_scores=True, return_dict_in_generate=True,
                                      **processor_kwargs(body, len(ids), tok))
        new = out.sequences[0, len(ids):].tolist()
        finish = "stop" if new and new[-1] in (tok.eos_token_id, *body.get("stop_token_ids", ())) else "length"
        text = tok.decode(new, skip_special_tokens=True)
        for stop in body.get("stop") or []:
            at = text.find(stop)
            if at >= 0:
                text, finish = text[:at], "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": new}
        if body.get("logprobs"):
            choice["logprobs"] = self._logprobs(out.scores, new, body, chat)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "cmpl-test", "object": "chat.completion" if chat else "text_completion", "model": self.name,
                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(new),
                                               "total_tokens": len(ids) + len(new)}}

    def _logprobs(self, scores: Any, new: list[int], body: dict[str, Any], chat: bool) -> dict[str, Any]:
        k = int(body.get("top_logprobs", 0) if chat else body["logprobs"])
        name = (lambda i: f"token_id:{i}") if body.get("return_tokens_as_token_ids") else (
            lambda i: self.tokenizer.decode([i]))
        picked, tops = [], []
        for token, logits in zip(new, scores):
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            values, indices = lp.topk(k)
            picked.append(float(lp[token]))
            tops.append({name(int(i)): float(v) for v, i in zip(values, indices)})
        if chat:
            return {"content": [{"token": name(t), "logprob": p, "top_logprobs": [
                {"token": n, "logprob": v} for n, v in top.items()]} for t, p, top in zip(new, picked, tops)]}
        return {"tokens": [name(t) for t in new], "token_logprobs": picked, "top_logprobs": tops}


class Faults:
    """Which fault (if any) the next request gets: drawn from a seeded generator among the first `first` requests
    (all of them when None), so that a run's faults repeat and the tail of a run shows the recovery."""

    def __init__(self, spec: str, seed: int, first: int | None):
        self.shares = {k: float(v) for k, v in (item.split("=") for item in spec.split(",") if item)}
        self.rng = random.Random(seed)
        self.first = first
        self.count = 0
        self.lock = threading.Lock()

    def draw(self) -> str | None:
        with self.lock:
            self.count += 1
            draw = self.rng.random()
            if self.first is not None and self.count > self.first:
                return None
        edge = 0.0
        for name, share in self.shares.items():
            edge += share
            if draw < edge:
                return name
        return None


def mangle(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    """`answer` as a lying server would send it."""
    usage, choice = answer["usage"], answer["choices"][0]
    if kind.startswith("usage_"):
        usage["prompt_tokens"] = {"usage_null": None, "usage_str": str(usage["prompt_tokens"]),
                                  "usage_negative": -5}.get(kind, usage["prompt_tokens"])
        usage["completion_tokens"] = {"usage_null": None, "usage_huge": 2 ** 40}.get(kind, usage["completion_tokens"])
    elif kind == "two_choices":
        answer["choices"] = [{**choice, "index": 1, "text": "WRONG", "token_ids": [3, 3, 3]}, choice]
    elif kind == "bad_index":
        choice["index"] = 9
    elif kind == "bad_ids":
        choice["token_ids"] = [1000000000]
    return answer


MODEL_ANSWERS = {"html": "<html><body>Sign in to the gateway</body></html>", "not_list": [1, 2],
                 "str_items": {"data": ["tiny"]}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    backend: Backend
    faults: Faults
    log_path: str | None = None
    reject: str = "REJECT"  # a prompt holding this word is answered 400
    models: str = "list"  # what /v1/models answers
    log_lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    @property
    def route(self) -> str:
        """The request's path without its query (a gateway's key may ride in it)."""
        return self.path.split("?", 1)[0].rstrip("/")

    def _send(self, status: int, data: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def _log(self, body: dict[str, Any], outcome: str) -> None:
        if self.log_path:
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
            line = json.dumps({"path": self.path, "digest": digest, "outcome": outcome, "seed": body.get("seed"),
                               "prompt": body.get("prompt"), "messages": body.get("messages"),
                               "processors": {k: body[k] for k in PROCESSOR_FIELDS if k in body},
                               "auth": self.headers.get("Authorization")})
            with self.log_lock, open(self.log_path, "a") as f:
                f.write(line + "\n")

    def do_GET(self) -> None:
        if self.route != "/v1/models":
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        b = self.backend
        if self.models in MODEL_ANSWERS:
            return self._send_raw(MODEL_ANSWERS[self.models])
        length = "lots" if self.models == "bad_len" else b.max_model_len
        return self._send(200, {"object": "list", "data": [{"id": b.name, "object": "model", "root": b.model_dir,
                                                            "owned_by": "tests", "max_model_len": length}]})

    def _send_raw(self, data: Any) -> None:
        raw = (data if isinstance(data, str) else json.dumps(data)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if isinstance(data, str) else "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        chat = self.route == "/v1/chat/completions"
        if not chat and self.route != "/v1/completions":
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        if body.get("model") != self.backend.name:
            return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
        fault = self.faults.draw()
        if fault in ("429", "503", "drop"):
            return self._fault(body, fault)
        if fault == "slow":
            time.sleep(2.0)
        return self._answer(body, chat)

    def _fault(self, body: dict[str, Any], fault: str) -> None:
        self._log(body, fault)
        if fault == "drop":  # the connection closes without an answer
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self._send(int(fault), {"error": {"message": "overloaded"}}, {"Retry-After": "1"} if fault == "429" else None)

    def _answer(self, body: dict[str, Any], chat: bool) -> None:
        tok = self.backend.tokenizer
        text = json.dumps(body.get("messages")) if chat else (
            body["prompt"] if isinstance(body["prompt"], str) else tok.decode(body["prompt"]))
        if self.reject and self.reject in text:
            self._log(body, "400")
            return self._send(400, {"error": {"message": "the prompt asks to be rejected"}})
        echo = re.search(r"ECHO:(\d+)", text)
        if echo:  # a careless server's error: the request line, its credential header and its body quoted back
            self._log(body, echo.group(1))
            said = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
            return self._send(int(echo.group(1)), {"error": {"message": f"bad request to {self.path} (authorization: "
                                                                      f"{self.headers.get('Authorization')}) body: "
                                                                      f"{json.dumps(said)}"}})
        refused = re.search(r"REFUSE:(\w+)", text)
        if refused and refused.group(1) in body:  # OpenAI's words for a parameter the model does not take
            self._log(body, "400")
            field = refused.group(1)
            return self._send(400, {"error": {"message": f"Unsupported parameter: '{field}' is not supported with "
                                                         f"this model.", "param": field}})
        try:
            answer = self.backend.complete(body, chat)
        except ValueError as exc:
            self._log(body, "400")
            return self._send(400, {"error": {"message": str(exc)}})
        lie = re.search(r"MANGLE:(\w+)", text)
        if lie:
            self._log(body, f"200 {lie.group(1)}")
            return self._send(200, mangle(answer, lie.group(1)))
        self._log(body, "200")
        return self._send(200, answer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default="tiny")
    parser.add_argument("--faults", default="")
    parser.add_argument("--log", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-requests", type=int, default=None, help="only the first N requests may fault")
    parser.add_argument("--reject", default="REJECT", help="prompts holding this word get HTTP 400 ('': none)")
    parser.add_argument("--models", default="list", help="/v1/models answers: list, html, not_list, str_items, "
                        "bad_len")
    args = parser.parse_args()
    torch.set_num_threads(1)
    Handler.backend = Backend(args.model, args.name)
    Handler.faults = Faults(args.faults, args.seed, args.fault_requests)
    Handler.log_path = args.log
    Handler.reject = args.reject
    Handler.models = args.models
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
