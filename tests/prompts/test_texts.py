"""The config's text keys (texts.py): one rule for a newline, the same on the command line and in YAML, applied by
validate once, so that the stop strings, templates, system prompt, choices, a chat template's text and decide's
questions hold the newlines the user wrote; a backslash and an n are written `\\\\n`."""

from __future__ import annotations

import pytest

from batchgen.checks import validate
from batchgen.commands import compose
from batchgen.commands.compose import compose_checked
from batchgen.job import JobConfig, Question
from batchgen.output.manifest import output_config
from batchgen.prompts.texts import escape, unescape
from tests.conftest import dummy_overrides, job_overrides, write_parquet

NEWLINE, BACKSLASH_N = "\n", "\\n"


def test_the_rule_makes_newlines_tabs_and_backslashes_and_escape_writes_it_back():
    assert unescape(r"a\nb\tc\\nd\q") == "a\nb\tc\\nd\\q"  # any other backslash stays as written
    for text in ("a\nb", BACKSLASH_N, "c:\\dir\\new", "\t\\\\", ""):
        assert unescape(escape(text)) == text


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(compose, "_config_dirs", [str(tmp_path / "conf")])
    monkeypatch.delenv(compose.USER_CONF_ENV, raising=False)
    (tmp_path / "conf" / "job").mkdir(parents=True)
    return tmp_path / "conf"


def test_a_newline_and_a_backslash_n_mean_the_same_on_the_command_line_and_in_every_yaml_quoting(
        tiny_model, tmp_path, config_dir):
    """`sampling.stop=["\\n"]` on a command line was a backslash and an n (generations ran past the newline they
    were meant to stop at): now a newline, as a preset's '\\n', "\\n" and plain \\n; a backslash and an n is `\\\\n`
    in each (in YAML's double quotes, whose own escapes come first, "\\\\\\\\n")."""
    (config_dir / "job" / "nl.yaml").write_text(
        "# @package _global_\nname: nl\ndataset:\n  template: Q {prompt}\\nA\n"
        "sampling:\n  stop: ['\\n', \"\\n\", '\\\\n', \"\\\\\\\\n\"]\n")
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    base = dummy_overrides(tiny_model, data, tmp_path / "out")[1:]
    preset = compose_checked(["job=nl", *base])
    cli = compose_checked(["name=nl", *base, 'sampling.stop=["\\n","\\n","\\\\n","\\\\n"]',
                           'dataset.template="Q {prompt}\\nA"'])
    assert preset.sampling.stop == cli.sampling.stop == [NEWLINE, NEWLINE, BACKSLASH_N, BACKSLASH_N]
    assert preset.dataset.template == cli.dataset.template == "Q {prompt}\nA"


def test_every_text_key_gets_its_newlines_at_validation_and_only_once(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    base = job_overrides(tiny_model, data, tmp_path / "out")
    cfg = compose_checked([*base, 'sampling.choice=["yes\\n","no\\\\n"]', 'dataset.system_prompt="One.\\nTwo."',
                           'dataset.chat_template="{{ messages[0].content }}\\n"'])
    assert cfg.sampling.choice == ["yes\n", "no\\n"]
    assert (cfg.dataset.system_prompt, cfg.dataset.chat_template) == ("One.\nTwo.", "{{ messages[0].content }}\n")
    again = validate(cfg)  # validated twice (the CLI, then run_job): a backslash and an n stays one
    assert again.sampling.choice == ["yes\n", "no\\n"] and again.dataset.system_prompt == "One.\nTwo."
    given = JobConfig(name="d", task="decide", output_dir=str(tmp_path / "o"))
    given.engine.model, given.dataset.path = tiny_model, str(data)
    given.decide.questions = [Question(name="q", kind="choice", prompt="\\nIs it?", options=["a\\tb", "c"])]
    decided = validate(given)
    assert given.decide.questions[0].prompt == "\\nIs it?"  # the caller's config is left as it was
    assert (decided.decide.questions[0].prompt, decided.decide.questions[0].options) == ("\nIs it?", ["a\tb", "c"])
    assert validate(cfg.escaped()).sampling.choice == cfg.sampling.choice  # a manifest's config rebuilds it


def test_an_output_made_since_templates_took_escapes_is_compared_as_written(tiny_model, tmp_path):
    """The manifest compares the template as it was written (`\\n`, with text_escapes), as it did when only the
    template and the system prompt took escapes, so such an output resumes under the same hash."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    cfg = compose_checked([*dummy_overrides(tiny_model, data, tmp_path / "out"), 'dataset.template="Q {prompt}\\nA"'])
    assert cfg.dataset.template == "Q {prompt}\nA"
    compared = output_config(cfg)["dataset"]
    assert compared["template"] == "Q {prompt}\\nA" and compared["text_escapes"] is True
