"""Secrets out of everything batchgen writes: the one redaction of URLs, used by the manifest, the status file,
the job's log and Hydra's saved config under `_logs/`, and error texts.

A URL's user name and password (`http://user:PASSWORD@host/v1`) and its query values (`?api_key=KEY`, a signed
URL's `X-Amz-Signature=...`) are what gateways, object stores and catalogs take as credentials; both are replaced
by `***`, the rest of the URL kept so that a reader still sees where it pointed. Knows text, not HTTP.
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# a scheme, '://', then anything up to whitespace, a quote or a bracket that ends a URL in prose, YAML or JSON
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
_QUERY_VALUE = re.compile(r"=[^&;#]*")


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
    """Every URL in `text` redacted (redact_url)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def redact(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string redacted; other values as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


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
