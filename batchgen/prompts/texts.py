"""The config's text keys and the one rule for writing a newline in them. In every key whose text reaches the model
or cuts its output (TEXT_KEYS), the two characters `\\n` are a newline, `\\t` a tab and `\\\\` one backslash (so
`\\\\n` is a backslash and an n); any other backslash stays as written. A command line cannot pass a real newline
through Hydra's grammar and a YAML preset's plain or single-quoted text keeps backslashes as written, so the rule
makes every way of writing a key mean the same; YAML's double quotes have already made "\\n" a newline, which the rule
leaves alone. checks.validate applies it once (JobConfig.map_texts), to the config it returns; row values are data
and never unescaped. Knows the config's text keys (handed their sections, from a JobConfig or Hydra's config for
`--cfg job`), not Hydra."""

from __future__ import annotations

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
    """Apply the rule to every text key of `cfg` (Hydra's composed config, for `--cfg job`), in place; a JobConfig
    does the same with its own map_texts."""
    map_texts(cfg.dataset, cfg.sampling, cfg.decide.questions, unescape)


def map_texts(dataset: Any, sampling: Any, questions: Any, fn: Callable[[str], str]) -> None:
    """`fn` applied to each text of TEXT_KEYS (a config's dataset, sampling and decide questions), in place; a value
    of another type is left for validation to name."""
    for key in ("template", "system_prompt"):
        setattr(dataset, key, _one(getattr(dataset, key), fn))
    if isinstance(dataset.chat_template, str) and not os.path.isfile(dataset.chat_template):  # a file: as read
        dataset.chat_template = fn(dataset.chat_template)
    sampling.stop = _many(sampling.stop, fn)
    sampling.choice = _many(sampling.choice, fn)
    for question in questions:
        question.prompt = _one(question.prompt, fn)
        question.options = _many(question.options, fn)


def _one(value: Any, fn: Callable[[str], str]) -> Any:
    return fn(value) if isinstance(value, str) else value


def _many(values: Any, fn: Callable[[str], str]) -> Any:
    return values if values is None or isinstance(values, str) else [_one(v, fn) for v in values]
