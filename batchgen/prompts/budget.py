"""A chat template's budget for one row: the CPU time and the text its rendering may spend
(`dataset.render_timeout_s`, MAX_TEXT_CHARS).

Jinja's sandbox, which transformers renders chat templates in, keeps a template away from Python's internals but not
from looping for ever: `range` stops at 100,000 items, and two loops over it nested, or over a long row value, are
10^10 steps. Python cannot kill a thread, so the limit is checked from inside the rendering: for its duration a trace
function (sys.settrace, this thread only) sees each line the compiled template runs and each piece of text it
yields, and raises RenderBudgetExceeded once the thread's CPU time passes the budget or the text passes
MAX_TEXT_CHARS. Only frames of compiled template code are traced line by line; any tracer already set (a coverage
tool, a debugger) keeps seeing every other frame. A single step the template takes in C (`'x' * 10**10`) is not
interrupted. Knows Jinja's compiled code by its file name only; nothing of tokenizers or rows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Optional

TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template given as text under
MAX_TEXT_CHARS = 1 << 24  # text one row's template may yield: 16 Mi characters, past any model's context
CHECK_EVERY = 64  # template lines run between two looks at the thread's CPU clock

Tracer = Callable[[FrameType, str, Any], Any]


class RenderBudgetExceeded(BaseException):
    """A rendering ran past its budget. A BaseException, as KeyboardInterrupt is: the template machinery's own
    `except Exception` must not swallow it (a trace function that raises is unset, so the rest would run
    unchecked); the renderer catches it by name and makes it the row's error."""


@dataclass(slots=True)
class _Budget:
    seconds: float  # the budget, CPU seconds of the rendering thread
    deadline: float  # time.thread_time() past which the rendering stops
    previous: Optional[Tracer]  # the tracer set before this rendering, still called for every other frame
    lines: int = 0  # template lines run so far
    chars: int = 0  # characters the template's frames yielded or returned so far

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        """sys.settrace's function: a template frame is traced line by line, any other by the previous tracer."""
        if frame.f_code.co_filename == TEMPLATE_FILE:
            return self.on_line
        return self.previous(frame, event, arg) if self.previous is not None else None

    def on_line(self, frame: FrameType, event: str, arg: Any) -> Tracer:
        """A template frame's events: each line counts towards a look at the clock, each text it yields (a
        generator's 'return' event) towards MAX_TEXT_CHARS."""
        if event == "line":
            self.lines += 1
            if self.lines % CHECK_EVERY == 0 and time.thread_time() > self.deadline:
                raise RenderBudgetExceeded(f"ran past dataset.render_timeout_s={self.seconds:g} CPU seconds on this "
                                           f"row (a loop without end?); fix the template, or raise the key")
        elif event == "return" and isinstance(arg, str):
            self.chars += len(arg)
            if self.chars > MAX_TEXT_CHARS:
                raise RenderBudgetExceeded(f"rendered more than {MAX_TEXT_CHARS} characters for this row; fix the "
                                           f"template")
        return self.on_line


@contextmanager
def render_budget(seconds: float) -> Iterator[None]:
    """Run the block (one row's template rendering) under a budget of `seconds` of this thread's CPU time;
    RenderBudgetExceeded from inside it where the template runs past that or past MAX_TEXT_CHARS."""
    previous = sys.gettrace()
    budget = _Budget(seconds, time.thread_time() + seconds, previous)
    sys.settrace(budget.on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
