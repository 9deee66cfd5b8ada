"""engine=openai: the job's requests sent to an OpenAI-compatible endpoint, under the same parts, journal and resume
as the in-process engines (only the engine changes).

At start the endpoint's /models must list engine.model; what it says of the model (id, root, max_model_len) is the
engine's identity, recorded in the manifest, so a resume against another served model is refused like a weight
change. Each attempt is one HTTP request (wire.py builds it and reads the answer); dispatch.py keeps them in flight,
adapts the concurrency, retries and stops. The API key is read from the environment variable engine.api_key_env
names and goes only into the Authorization header. httpx is imported here only.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any, Optional

from batchgen.engines.base import CHARS_PER_TOKEN, EngineStats, Source, generate_by_stream
from batchgen.engines.endpoint import wire
from batchgen.engines.endpoint.config import OpenAIConfig
from batchgen.engines.endpoint.dispatch import Dispatcher, EndpointDown, Outcome
from batchgen.errors import BatchgenError, ConfigError
from batchgen.records import Request, Result
from batchgen.redact import redact_text, remember

log = logging.getLogger(__name__)
TRANSIENT = (408, 409, 425, 500, 502, 504)  # retried; 429 and 503 also halve the concurrency
OVERLOAD = (429, 503)
FATAL = {401: "the endpoint refused the API key: check the variable engine.api_key_env names",
         403: "the endpoint refused the API key: check the variable engine.api_key_env names",
         404: "no such path or model on the endpoint: check engine.base_url (up to /v1), engine.endpoint and "
              "engine.model"}
RETRY_AFTER_CAP_S = 600.0  # a longer Retry-After (a quota reset hours away) is waited this long, then asked again
DEFAULT_MAX_LEN = 1 << 20  # where neither the server nor engine.max_model_len says (a hosted API rejects too long)


class EndpointError(BatchgenError):
    """The endpoint refuses the job as configured (a key, a path, a model it does not serve)."""

    exit_code = 2


class OpenAIEngine:
    def __init__(self, cfg: OpenAIConfig, tokenizer: Any):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.chat = cfg.endpoint == "chat"
        self.vllm = cfg.extensions == "vllm"
        self.client, self.httpx = _client(cfg)
        self.path = "chat/completions" if self.chat else "completions"
        self.served = served_model(cfg, self.client, self.httpx)
        self.max_model_len = int(cfg.max_model_len or self.served.get("max_model_len") or DEFAULT_MAX_LEN)
        self.max_batch_size: Optional[int] = None  # the server's batch is its own
        self.dispatcher = Dispatcher(self.send, most=cfg.max_concurrency, max_retries=cfg.max_retries,
                                     stop_grace_s=cfg.stop_grace_s)
        self.estimates_said = False  # without a tokenizer: whether an answer without usage counts was logged
        log.info("openai engine: %s at %s (%s endpoint, up to %d requests in flight, max_model_len=%d)",
                 cfg.model, shown_url(cfg.base_url), cfg.endpoint, cfg.max_concurrency, self.max_model_len)
        if tokenizer is None:
            log.info("openai engine: no engine.tokenizer: the token counts (num_prompt_tokens, num_generated_tokens) "
                     "are the server's usage; prompt lengths are estimated from characters, so run.too_long is not "
                     "checked before sending (a prompt too long for the server is its row's endpoint_rejected error)")

    def stats(self) -> EngineStats:
        return EngineStats()

    def identity(self) -> dict[str, Any]:
        return {"engine": "openai", "dtype": None, "endpoint": self.cfg.endpoint,
                "base_url": shown_url(self.cfg.base_url), "served_model": self.served}

    def close(self) -> None:
        self.dispatcher.close()
        self.client.close()

    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        return generate_by_stream(self.stream, requests, on_result)

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        self.dispatcher.run(source, on_result)

    def send(self, req: Request) -> Outcome:
        """One attempt of one request (on a dispatcher thread)."""
        httpx = self.httpx
        messages = req.messages if self.chat else None
        payload = wire.body(req, self.cfg.model, self.chat, self.vllm, messages, self.cfg.extra_body,
                            token_ids=self.tokenizer is not None)
        try:
            response = self.client.post(self.path, json=payload)
        except httpx.TimeoutException:
            return Outcome(transient=f"no answer within engine.timeout_s={self.cfg.timeout_s:g} s", overload=True)
        except httpx.TransportError as exc:  # refused, reset, dropped mid-answer
            return Outcome(transient=redact_text(f"{type(exc).__name__}: {exc}"))
        status = response.status_code
        if status == 200:
            return self.answer(req, response)
        if status in OVERLOAD:
            return Outcome(transient=f"HTTP {status}", overload=True,
                           retry_after=retry_after(response.headers.get("retry-after")))
        if status in TRANSIENT or status >= 500:
            return Outcome(transient=f"HTTP {status}")
        if status in FATAL:
            raise EndpointError(f"{shown_url(self.cfg.base_url)}/{self.path}: HTTP {status}: {FATAL[status]} "
                                f"({_message(response)})")
        return Outcome(result=wire.error_result(req, status, _message(response), payload))

    def answer(self, req: Request, response: Any) -> Outcome:
        """A 200's body as the sample's Result. Without a tokenizer, the first answer whose usage lacks a count is
        logged: that sample's counts are estimates from characters, not the server's."""
        try:
            data = response.json()
            result = wire.result(req, data, self.chat, self.tokenizer)
        except Exception as exc:  # a torn or foreign body (not JSON, no choices, a list): ask again
            return Outcome(transient=f"unreadable answer ({type(exc).__name__}: {exc})")
        if self.tokenizer is None and not self.estimates_said and not wire.counted(data):
            self.estimates_said = True
            log.warning("openai engine: the server sent an answer without usage token counts: without "
                        "engine.tokenizer such a sample's counts are estimated from characters (%d a token)",
                        CHARS_PER_TOKEN)
        return Outcome(result=result)


def served_model(cfg: OpenAIConfig, client: Any, httpx: Any) -> dict[str, Any]:
    """What /models says of engine.model (the identity); refuses a model the endpoint does not serve. An endpoint
    without /models (404, 405) is identified by engine.model alone; a busy or failing one is asked again, never
    recorded with less than it would say when well (a later resume would be refused)."""
    url = shown_url(cfg.base_url)
    for attempt in range(cfg.max_retries + 1):
        try:
            response = client.get("models")
            why = f"HTTP {response.status_code}"
        except httpx.TransportError as exc:
            response, why = None, redact_text(f"no answer ({type(exc).__name__}: {exc}); is the server up?")
        if response is not None and (response.status_code < 500 and response.status_code != 429):
            break
        if attempt == cfg.max_retries:
            raise EndpointDown(f"engine.base_url={url}: /models: {why} after {attempt + 1} attempts")
        time.sleep(min(30.0, 0.5 * 2 ** attempt))
    if response.status_code in (401, 403):
        raise EndpointError(f"{url}/models: HTTP {response.status_code}: {FATAL[401]}")
    if response.status_code in (404, 405):
        log.warning("%s/models answered HTTP %d: the served model's identity is engine.model alone", url,
                    response.status_code)
        return {"id": cfg.model}
    if response.status_code != 200:
        raise EndpointError(f"{url}/models: HTTP {response.status_code}: {_message(response)}")
    models = model_list(response, url)
    for m in models:
        if m.get("id") == cfg.model:
            return _identity(m, url, cfg.max_model_len)
    served = ", ".join(repr(m.get("id")) for m in models) or "none"
    raise ConfigError([f"engine.model={cfg.model!r}: {url} serves {served}; set "
                       f"engine.model to one of them"])


def model_list(response: Any, url: str) -> list[dict[str, Any]]:
    """/models' answer as OpenAI's model list ({"data": [{"id": ...}, ...]}); anything else (a web UI's page, a
    gateway's error, another API) is an EndpointError naming engine.base_url and what came back."""
    try:
        data = response.json()
    except ValueError:
        data = None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and all(isinstance(m, dict) for m in models):
        return models
    what = response.headers.get("content-type") or "no content type"
    excerpt = " ".join(response.text[:200].split())
    raise EndpointError(f"engine.base_url={url}: {url}/models answered HTTP 200 with something that is not an "
                        f"OpenAI model list ({what}: {excerpt!r}); set engine.base_url to the OpenAI-compatible "
                        f"API's root, up to /v1")


def _identity(model: dict[str, Any], url: str, configured: Optional[int]) -> dict[str, Any]:
    """What /models says of the served model, checked: root a string, max_model_len a positive int (where it is not,
    engine.max_model_len, when set, stands in for it, logged)."""
    out = {k: model[k] for k in ("id", "root", "max_model_len") if model.get(k) is not None}
    if not isinstance(out.get("root", ""), str):
        out["root"] = str(out["root"])
    length = out.get("max_model_len")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        said = f"/models says max_model_len={wire.short(length)} for {model['id']!r}"
        if not configured:
            raise EndpointError(f"engine.base_url={url}: {said}, not a positive number of tokens; set "
                                f"engine.max_model_len to the served model's")
        log.warning("%s: %s, not a number of tokens; engine.max_model_len=%d is used", url, said, configured)
        del out["max_model_len"]
    return out


def served_max_len(cfg: OpenAIConfig) -> int:
    """The served model's max_model_len as the endpoint's /models says (DEFAULT_MAX_LEN where it says none), for
    `batchgen plan`, which loads no engine."""
    client, httpx = _client(cfg)
    try:
        return int(served_model(cfg, client, httpx).get("max_model_len") or DEFAULT_MAX_LEN)
    finally:
        client.close()


def _client(cfg: OpenAIConfig) -> tuple[Any, Any]:
    """An httpx client for the endpoint, and the httpx module. The API key, if any, goes in the Authorization header
    (a Bearer token); a user and password in engine.base_url become Basic auth (config.py refuses both at once); a
    query in engine.base_url (a gateway's key) is sent with every request. httpx's own request lines stay out of
    the job's log (one a request, each with the URL)."""
    import httpx

    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    base, query, auth = split_url(cfg.base_url)
    key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
    remember(key)  # masked wherever a text quotes it (a server's error echoing the request)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base.rstrip("/") + "/", headers=headers, params=query, auth=auth,
                        timeout=httpx.Timeout(cfg.timeout_s, connect=min(30.0, cfg.timeout_s)),
                        limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                            max_keepalive_connections=cfg.max_concurrency)), httpx


def split_url(url: str) -> tuple[str, list[tuple[str, str]], Optional[tuple[str, str]]]:
    """engine.base_url as the URL requests are made under (no user, password or query), its query parameters, and
    its user and password (None where it has none)."""
    from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

    parts = urlsplit(url)
    auth = (unquote(parts.username or ""), unquote(parts.password or "")) if "@" in parts.netloc else None
    base = urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))
    return base, parse_qsl(parts.query, keep_blank_values=True), auth


def shown_url(url: str) -> str:
    """engine.base_url as written to the manifest, part metadata and logs: no user:password and no query (where
    some gateways take a key)."""
    return split_url(url)[0]


def retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header in seconds (delta-seconds or an HTTP date), at most RETRY_AFTER_CAP_S (logged when
    capped); None where absent or unreadable."""
    seconds = _retry_after(value)
    if seconds is not None and seconds > RETRY_AFTER_CAP_S:
        log.warning("endpoint: Retry-After %s capped at %g s", value, RETRY_AFTER_CAP_S)
        return RETRY_AFTER_CAP_S
    return seconds


def _retry_after(value: Optional[str]) -> Optional[float]:
    if not value:
        return None
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return None


def _message(response: Any) -> str:
    """The server's error message (OpenAI's {"error": {"message": ...}}, vLLM's {"message": ...}) or the body."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if data.get("message"):
            return str(data["message"])
    return json.dumps(data)[:500]
