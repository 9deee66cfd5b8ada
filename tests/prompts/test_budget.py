"""A template rendering's budget on its own: loops without end stop within the budget, whatever they loop over; a
template that yields text without end stops at MAX_TEXT_CHARS; a tracer set before (coverage, a debugger) is kept."""

from __future__ import annotations

import sys
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchgen.prompts import budget
from batchgen.prompts.budget import RenderBudgetExceeded, render_budget

ENV = ImmutableSandboxedEnvironment()
HOSTILE = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested ranges, empty body": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested loops over a long string": "{% for a in s %}{% for b in s %}{{ b }}{% endfor %}{% endfor %}",
    "nested loops over a long list": "{% for a in xs %}{% for b in xs %}{% endfor %}{% endfor %}",
    "a macro calling itself twice": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                                    "{{ f(60) }}",
    "a join in a loop": "{% for i in range(100000) %}{{ range(100000) | join | length }}{% endfor %}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_template_looping_for_ever_stops_at_its_budget(name):
    template = ENV.from_string(HOSTILE[name])
    start = time.monotonic()
    with pytest.raises(RenderBudgetExceeded, match=r"dataset\.render_timeout_s=0\.3 CPU seconds"):
        with render_budget(0.3):
            template.render(s="y" * 100_000, xs=list(range(100_000)))
    assert time.monotonic() - start < 3


def test_a_template_yielding_text_without_end_stops_at_the_text_cap(monkeypatch):
    monkeypatch.setattr(budget, "MAX_TEXT_CHARS", 10_000)
    template = ENV.from_string("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")
    with pytest.raises(RenderBudgetExceeded, match="more than 10000 characters"):
        with render_budget(60):
            template.render()


def test_a_template_within_its_budget_renders_as_without_one():
    template = ENV.from_string("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    messages = [{"role": "user", "content": f"row {i}"} for i in range(200)]
    with render_budget(0.5):
        text = template.render(messages=messages)
    assert text == template.render(messages=messages)


def test_the_tracer_set_before_keeps_seeing_other_frames_and_is_set_again_after():
    seen: list[str] = []

    def tracer(frame, event, arg):
        seen.append(frame.f_code.co_name)
        return None

    def outside():
        return 1

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        with render_budget(1):
            outside()
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert "outside" in seen
