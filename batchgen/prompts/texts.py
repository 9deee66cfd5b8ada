"""The config's text keys and the one rule for writing a newline in them. In every key whose text reaches the model
or cuts its output (TEXT_KEYS), the two characters `\\n` are a newline, `\\t` a tab and `\\\\` one backslash (so
`\\\\n` is a backslash and an n); any other backslash stays as written. A command line cannot pass a real newline
through Hydra's grammar and a YAML preset's plain or single-quoted text keeps backslashes as written, so the rule
makes every way of writing a key mean the same; YAML's double quotes have already made "\\n" a newline, which the rule
leaves alone. checks.validate applies it once, to the config it returns; row values are data and never unescaped.
Knows the config's shape (any object of it: a JobConfig, or Hydra's config for `--cfg job`), not Hydra."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from typing import Any

# as the user types them: each a text, a list of texts, or each question's text
TEXT_KEYS = ("dataset.template", "dataset.system_prompt", "dataset.chat_template (its text, not a file's)",
             "sampling.stop", "sampling.choice", "decide.questions[].prompt", "decide.questions[].options")
ESCAPE = re.compile(r"\\(\\|n|t)")
UNESCAPED = {"n": "\n", "t": "\t", "\\": "\\"}
ESCAPED = {"\\": "\\\\", "\n": "\\n", "\t": "\\t"}


def unescape(value: str) -> str:
    """`value` as used: `\\n`, `\\t` and `\\\\` written as two characters made a newline, a tab and a backslash."""
    return ESCAPE.sub(lambda m: UNESCAPED[m.group(1)], value)


def escape(value: str) -> str:
    """The inverse of unescape: the text as the config writes it (unescape(escape(text)) == text)."""
    return "".join(ESCAPED.get(c, c) for c in value)


def unescape_texts(cfg: Any) -> None:
    """Apply the rule to every text key of `cfg`, in place."""
    map_texts(cfg, unescape)


def escaped_copy(cfg: Any) -> Any:
    """A copy of a validated config with its text keys written back as a config writes them (a manifest's config,
    from which `batchgen retry` builds and validates the job again)."""
    out = copy.deepcopy(cfg)
    map_texts(out, escape)
    out.texts_unescaped = False  # written again: validating the copy makes its newlines once more
    return out


def map_texts(cfg: Any, fn: Callable[[str], str]) -> None:
    """`fn` applied to each text of TEXT_KEYS in `cfg`, in place; a value of another type is left for validation to
    name."""
    ds, s = cfg.dataset, cfg.sampling
    for key in ("template", "system_prompt"):
        setattr(ds, key, _one(getattr(ds, key), fn))
    if isinstance(ds.chat_template, str) and not os.path.isfile(ds.chat_template):  # a file's text is as read
        ds.chat_template = fn(ds.chat_template)
    s.stop = _many(s.stop, fn)
    s.choice = _many(s.choice, fn)
    for question in cfg.decide.questions:
        question.prompt = _one(question.prompt, fn)
        question.options = _many(question.options, fn)


def _one(value: Any, fn: Callable[[str], str]) -> Any:
    return fn(value) if isinstance(value, str) else value


def _many(values: Any, fn: Callable[[str], str]) -> Any:
    return values if values is None or isinstance(values, str) else [_one(v, fn) for v in values]
