"""Secrets out of everything batchgen writes or prints: the one redaction, used by the manifest, the status file,
the job's log, Hydra's saved config under `_logs/`, the report, every row's error and every error text.

Three rules, each masking a value with `***` and keeping what says where it was:
- a URL's user name and password (`http://user:PASSWORD@host/v1`) and its query values (`?api_key=KEY`, a signed
  URL's `X-Amz-Signature=...`);
- a value under a name that looks secret (secret_name: `api_key=...`, `"token": "..."`, `{password: ...}`, a
  dict's `AWS_SECRET_ACCESS_KEY` entry), an HTTP credential header's value (`authorization: Bearer ...`,
  `x-api-key: ...`) and a bearer token anywhere;
- every secret value this process knows, verbatim wherever it appears (remember, remember_secrets: the API key
  read from the environment, a URL's userinfo, the values under secret names in output.storage_options,
  output.catalog and engine.extra_body), so that a server's text echoing a request is masked too.
Knows text and JSON-like values, not HTTP or the job's config classes.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Optional
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

MASK = "***"
REMEMBERED_MIN = 4  # shorter values are masked only where a rule finds them: matched verbatim they would mask words
# a scheme, '://', then anything up to whitespace, a quote or a bracket that ends a URL in prose, YAML or JSON
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_QUERY_VALUE = re.compile(r"=[^&;#]*")
# a name's words: `AWS_SECRET_ACCESS_KEY`, `s3.secret-access-key`, `apiKey`, `X-Amz-Signature`
_WORDS = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_SECRET_ANYWHERE = frozenset({"secret", "password", "passwd", "pwd", "passphrase", "credential", "credentials",
                              "apikey", "auth", "authorization", "bearer", "cookie"})
_SECRET_LAST = frozenset({"key", "token", "session", "signature", "sig", "sas", "pass"})  # not max_tokens, key_env
# a value: quoted (its quotes kept), or up to whatever ends one in a URL, a header, JSON or YAML
_VALUE = r"""(?P<value>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[^\s&;#'",(){}\[\]<>]+)"""
_NAMED = (re.compile(r"(?P<name>[A-Za-z_][\w.-]*)(?P<sep>=)" + _VALUE),  # key=value (a query, an override)
          re.compile(r"(?P<name>([\"'])[A-Za-z_][\w.-]*\2)(?P<sep>\s*:\s*)" + _VALUE),  # JSON, a Python dict
          re.compile(r"(?:^|(?<=[{,]))(?P<name>[ \t]*[A-Za-z_][\w.-]*)(?P<sep>[ \t]*:[ \t]+)" + _VALUE, re.M))  # YAML
_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization|x-api-key|api-key|x-goog-api-key|cookie)"
                     r"([\"']?\s*[:=]\s*[\"']?)((?:bearer|basic|token|digest)\s+)?[^\s'\",;)}\]]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def secret_name(name: str) -> bool:
    """Whether a value under `name` is taken for a secret: a word of it is secret, password, credential, auth...,
    or its last word is key, token, session, signature (`aws_session_token`, `s3.secret-access-key`, `apiKey`; not
    `max_tokens`, `api_key_env`, `token_ids`)."""
    words = [w.lower() for w in _WORDS.findall(name)]
    return bool(words) and (words[-1] in _SECRET_LAST or any(w in _SECRET_ANYWHERE for w in words))


class _Known:
    """The secret values this process was told of (remember), as one pattern, longest first."""

    def __init__(self) -> None:
        self.values: set[str] = set()
        self.pattern: Optional[re.Pattern[str]] = None

    def add(self, value: str) -> None:
        forms = {value, value.strip(), quote(value, safe=""), unquote(value)}
        new = {f for f in forms if len(f) >= REMEMBERED_MIN and MASK not in f} - self.values
        if new:
            self.values |= new
            self.pattern = re.compile("|".join(re.escape(v) for v in sorted(self.values, key=len, reverse=True)))

    def sub(self, text: str) -> str:
        return self.pattern.sub(MASK, text) if self.pattern is not None else text


_known = _Known()


def remember(value: Any) -> None:
    """Mask `value` (a string or a number: an API key, a password) verbatim in every text redacted from now on, in
    this process."""
    if value is not None and not isinstance(value, bool) and isinstance(value, (str, int, float)):
        _known.add(str(value))


def remember_secrets(tree: Any) -> None:
    """remember every secret a config holds: in a JSON-like tree (or a dataclass), the values under secret names
    (secret_name) and every URL's user, password and query values under secret names."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = dataclasses.asdict(tree)
    if isinstance(tree, dict):
        for key, value in tree.items():
            (_remember_all if secret_name(str(key)) else remember_secrets)(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            remember_secrets(value)
    elif isinstance(tree, str) and "://" in tree:
        for url in _URL.findall(tree):
            _remember_url(url)


def _remember_all(value: Any) -> None:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            _remember_all(v)
    else:
        remember(value)


def _remember_url(url: str) -> None:
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return
    for value in (user, password) if "@" in parts.netloc else ():
        remember(value)
    for name, value in parse_qsl(parts.query, keep_blank_values=False):
        if secret_name(name):
            remember(value)


def redact_url(url: str) -> str:
    """`url` with its userinfo and every query value masked (`http://***@host/v1?api_key=***`); as it is where it
    holds neither."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL after all (an unbalanced bracket in an IPv6 host): mask all after the scheme
        return url.split("://", 1)[0] + "://" + MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rsplit("@", 1)[1]
    query = _QUERY_VALUE.sub("=" + MASK, parts.query) if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """`text` with every secret masked: the values this process remembers, every URL's credentials, credential
    headers and bearer tokens, and the values of secret-looking names."""
    text = _known.sub(text)
    if "://" in text:
        text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _HEADER.sub(lambda m: m.group(1) + m.group(2) + (m.group(3) or "") + MASK, text)
    text = _BEARER.sub(lambda m: m.group(1) + MASK, text)
    for rule in _NAMED:
        text = rule.sub(_masked_named, text)
    return text


def _masked_named(m: re.Match[str]) -> str:
    if not secret_name(m.group("name").strip(" \t\"'")):
        return m.group(0)
    value = m.group("value")
    shown = value[0] + MASK + value[0] if value[:1] in ("'", '"') else MASK
    return m.group("name") + m.group("sep") + shown


def redact(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string redacted and, in a dict, a string or number
    under a secret name (secret_name) masked whole; other values as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: MASK if _maskable(v) and secret_name(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


def _maskable(value: Any) -> bool:
    """A value that can hold a secret (a dict or list under a secret name is walked: its own names decide)."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != ""


def control_character(value: str) -> Optional[str]:
    """Where `value` holds a control character (a carriage return from a key file saved with Windows line ends, a
    newline, an escape), what it is and where, in words that never quote the value; None where it holds none."""
    found = _CONTROL.search(value)
    if found is None:
        return None
    at = "at its end" if found.start() >= len(value.rstrip("\r\n\x00")) else f"at character {found.start() + 1}"
    names = {"\r": "a carriage return (\\r)", "\n": "a newline (\\n)", "\t": "a tab (\\t)"}
    return f"{names.get(found.group(), f'a control character (0x{ord(found.group()):02x})')} {at}"


class RedactingFilter(logging.Filter):
    """A log handler's filter: the record's message (arguments merged in) and its traceback text redacted before
    any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def redact_logs(logger: logging.Logger) -> None:
    """Install RedactingFilter on every handler of `logger` (once each)."""
    for handler in logger.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
