"""engine=openai's settings: the shared engine keys, where the endpoint is and how to talk to it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional
from urllib.parse import urlsplit

from batchgen.engines.base import EngineConfig, model_dir_problems
from batchgen.redact import control_character, redact_text, remember, secret_name

ENDPOINTS = ("completions", "chat")
EXTENSIONS = ("vllm", "none")


@dataclass
class OpenAIConfig(EngineConfig):
    """engine.model is the served model's name (what the endpoint's /v1/models lists); engine.tokenizer a local
    tokenizer of that model, with which batchgen renders, counts and truncates prompts (where engine.model is a
    local directory, as vLLM's default served name is, it serves as the tokenizer). The chat endpoint runs without
    one (a hosted API): the server renders the messages and its usage gives the token counts; prompt lengths are
    then estimated from characters, so run.too_long is not checked before sending. The completions endpoint sends
    token ids and needs one."""

    MODEL_HAS_WEIGHTS: ClassVar[bool] = False

    name: str = "openai"
    base_url: str = "???"  # the endpoint up to /v1, e.g. http://127.0.0.1:8000/v1 (a query is sent with every
    # request, a user:password as Basic auth; neither is ever written)
    endpoint: str = "completions"  # completions: the prompt's token ids as batchgen rendered them; chat: messages
    api_key_env: Optional[str] = None  # the environment variable holding the API key (the key is never written)
    max_concurrency: int = 32  # requests in flight at most (fewer while the server pushes back)
    timeout_s: float = 600.0  # one request's limit
    max_retries: int = 8  # transient failures (429, 5xx, timeouts, dropped connections) per request, then exit 1
    stop_grace_s: float = 30.0  # on SIGTERM or an error: how long requests in flight may still finish
    extensions: str = "vllm"  # vllm: the server takes vLLM's extra fields (regex/choice/grammar, top_k, token ids)
    extra_body: dict[str, Any] = field(default_factory=dict)  # added to every request's JSON body

    def problems(self) -> list[str]:
        out = []
        if self.model in ("???", "", None):
            out.append("engine.model is required with engine=openai: the served model's name, as the endpoint's "
                       "/v1/models lists it")
        if control_character(str(self.base_url)):
            out.append(f"engine.base_url holds {control_character(str(self.base_url))} (not shown: it may hold a "
                       f"credential); set it without it")
        elif not str(self.base_url).startswith(("http://", "https://")):
            out.append(f"engine.base_url must be the endpoint's http(s) URL up to /v1, e.g. "
                       f"http://127.0.0.1:8000/v1 (got {redact_text(str(self.base_url))!r})")
        elif "@" in urlsplit(str(self.base_url)).netloc and self.api_key_env:
            out.append(f"engine.base_url={redact_text(self.base_url)} holds a user and password (sent as Basic auth) "
                       f"and engine.api_key_env={self.api_key_env} a Bearer key: an endpoint takes one "
                       f"Authorization; drop one of them")
        tokenizer = self.tokenizer_dir()
        if tokenizer is None and self.endpoint == "completions":
            out.append("engine.endpoint=completions needs engine.tokenizer: each prompt is sent as token ids, which "
                       "only a local tokenizer directory of the served model makes; set engine.tokenizer to one, or "
                       "engine.endpoint=chat (the server renders the messages and reports the token counts)")
        elif tokenizer is not None:
            out += model_dir_problems(tokenizer, "engine.tokenizer" if self.tokenizer else "engine.model",
                                      weights=False)
        if self.endpoint not in ENDPOINTS:
            out.append(f"engine.endpoint must be one of {', '.join(ENDPOINTS)} (got {self.endpoint!r})")
        if self.extensions not in EXTENSIONS:
            out.append(f"engine.extensions must be one of {', '.join(EXTENSIONS)} (got {self.extensions!r})")
        out += self.credential_problems()
        if self.dtype != "auto" or self.quantization is not None:
            out.append("engine.dtype and engine.quantization are the server's with engine=openai; leave them unset")
        out += [f"engine.{key} must be >= {low} (got {getattr(self, key)})"
                for key, low in (("max_concurrency", 1), ("timeout_s", 0.001), ("max_retries", 0),
                                 ("stop_grace_s", 0)) if getattr(self, key) < low]
        return out

    def credential_problems(self) -> list[str]:
        """The API key: set where engine.api_key_env names a variable, and remembered (masked in every text:
        redact.py); it and a value of engine.extra_body under a secret name (it goes into every request) refused
        where they hold a control character (a key file saved with Windows line ends), never quoted."""
        out = []
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        remember(key)
        if self.api_key_env and not key:
            out.append(f"engine.api_key_env={self.api_key_env}: the environment variable {self.api_key_env} is not "
                       f"set; export it (the key itself never goes into a config, manifest or log)")
        elif key and control_character(key):
            out.append(f"engine.api_key_env={self.api_key_env}: the key in {self.api_key_env} holds "
                       f"{control_character(key)} (the key is not shown); export it without it, e.g. "
                       f"export {self.api_key_env}=\"$(tr -d '\\r\\n' < KEYFILE)\"")
        out += [f"engine.extra_body.{name} holds {control_character(value)} (the value is not shown: it may be a "
                f"credential); set it without it" for name, value in self.extra_body.items()
                if isinstance(value, str) and secret_name(str(name)) and control_character(value)]
        return out

    def tokenizer_dir(self) -> Optional[str]:
        """The local tokenizer's directory: engine.tokenizer, else engine.model where it is a directory; None where
        there is none (the chat endpoint's server renders and counts)."""
        if self.tokenizer:
            return self.tokenizer
        return self.model if self.model and os.path.isdir(str(self.model)) else None
