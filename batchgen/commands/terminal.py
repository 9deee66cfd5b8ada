"""Untrusted text made safe to print on a terminal: what a command prints of row data (ids, prompts, generations,
errors, column names) goes through here, never raw.

A row's value may hold terminal escape sequences (ESC and CSI sequences that clear the screen or move the cursor,
OSC that retitles the window, BEL), other C0 and C1 controls, bidi overrides (U+202E) that reorder what is shown, and
newlines that print a line looking like the command's own framing (`--- row 2: ...`). Each such character is shown
as a visible escape (`\\x1b`, `\\u202e`, `\\n`); a multi-line value (a prompt --show prints) keeps its lines, each
after BLOCK_MARGIN, so that none can read as a line of the command's. JSON lines a command prints (`batchgen view`
on stdout) show each such character as JSON's `\\uXXXX`, so that they stay valid JSON holding the same values; the
console's log lines (a warning that quotes a row's id or error) are escaped by ConsoleFormatter. Knows characters,
not what a row is.
"""

from __future__ import annotations

import logging
import unicodedata
from typing import Any

from batchgen.errors import ConfigError

BLOCK_MARGIN = "| "  # before each line of a multi-line value: the command's own lines never start so
# Unicode categories shown escaped: controls (C0, DEL, C1), format characters (bidi overrides and isolates, zero
# widths), surrogates, private use, unassigned, and the line and paragraph separators
UNSAFE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_line(value: Any) -> str:
    """`value` as text for one line of a command's output: every unsafe character escaped, newlines and tabs too."""
    return _escaped(str(value), keep="")


def block(text: str) -> str:
    """A multi-line value as lines of a command's output: its lines kept, each after BLOCK_MARGIN, tabs kept, every
    other unsafe character escaped."""
    return "\n".join(BLOCK_MARGIN + _escaped(line, keep="\t") for line in text.split("\n"))


def lines(text: str) -> str:
    """A command's own multi-line message that may quote row data (an error, a summary): its newlines kept, every
    other unsafe character escaped."""
    return "\n".join(_escaped(line, keep="\t") for line in text.split("\n"))


def error_text(exc: BaseException) -> str:
    """An error's text for the console, where it may quote row data (an id, a column's name, a server's answer): a
    ConfigError's problems a line each, as its own text lists them, any other error on one line; each escaped."""
    if isinstance(exc, ConfigError):
        return "invalid config:\n" + "\n".join(f"  - {one_line(p)}" for p in exc.problems)
    return one_line(exc)


def json_line(text: str) -> str:
    """JSON text (json.dumps with ensure_ascii=False, which leaves C1 controls, DEL and bidi overrides raw) with every
    unsafe character as JSON's `\\uXXXX` (a surrogate pair above U+FFFF): the same JSON value, safe on a terminal.
    JSON's own syntax is ASCII, so only characters inside strings change."""
    if text.isprintable():
        return text
    return "".join(_json_escape(ch) if unicodedata.category(ch) in UNSAFE else ch for ch in text)


class ConsoleFormatter(logging.Formatter):
    """A console handler's formatter, since a log line may quote a row's id or a server's text: the message (its
    arguments merged in) on one line, every unsafe character escaped (so that no row forges a log line), then the
    line its own formatter gives, a traceback's lines kept and escaped."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        shown = logging.makeLogRecord(record.__dict__)
        shown.msg, shown.args = one_line(record.getMessage()), None
        return lines(self.inner.format(shown))


def escape_console(logger: logging.Logger) -> None:
    """Wrap the formatter of each of `logger`'s handlers that writes to a stream other than a file (the console) in
    ConsoleFormatter (once each); the run's log file keeps the text as it was logged."""
    for handler in logger.handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and not isinstance(handler.formatter, ConsoleFormatter):
            handler.setFormatter(ConsoleFormatter(handler.formatter))


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _escaped(text: str, *, keep: str) -> str:
    if text.isprintable():  # the common case: nothing to escape (isprintable is False for every UNSAFE category)
        return text
    return "".join(ch if ch in keep or unicodedata.category(ch) not in UNSAFE else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    if ch in NAMED:
        return NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
