"""task=decide's options, checked alike for a predicate and a choice: a repeated answer (every row split between
the two), an empty or blank one (scored as EOS alone, it wins every row) refused at start naming the question and
the option; an answer too long for any row under engine.max_model_len one ConfigError (exit 2) once the engine is
up, naming decide.questions[i].options[j], its token count and max_model_len, not every row a too_long error."""

from __future__ import annotations

import pytest

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, job_overrides, run_cli, write_jsonl

LONG = " ".join(["word"] * 120)  # well over max_model_len=64 tokens


def job(model: str, tmp_path, questions: str, *extra: str) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "the river"}, {"id": "b", "prompt": "a town"}])
    return job_overrides(model, data, tmp_path / "out", "task=decide", "dataset.id_column=id",
                         f"+decide.questions={questions}", *extra)


def test_repeated_and_blank_options_are_refused_for_predicates_and_choices(tiny_model, tmp_path):
    questions = ('[{name: ok, kind: predicate, prompt: " Ok?", options: [yes, yes]}, '
                 '{name: topic, kind: choice, prompt: " Topic:", options: [bug, "", billing, "  "]}, '
                 '{name: same, kind: choice, prompt: " Same:", options: [a, b, "a "]}]')
    with pytest.raises(ConfigError) as err:
        run_job(compose_job(job(tiny_model, tmp_path, questions)))
    text = str(err.value)
    assert "decide.questions[0].options[1] of question 'ok' is 'yes', the same answer as options[0]" in text
    assert "decide.questions[1].options[1] of question 'topic' is '': an answer must be non-blank" in text
    assert "decide.questions[1].options[3] of question 'topic' is '  '" in text
    assert "decide.questions[2].options[2] of question 'same' is 'a ', the same answer as options[0]" in text
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_an_option_too_long_for_any_row_is_one_config_error_not_every_row_too_long(tiny_model, tmp_path):
    questions = f'[{{name: topic, kind: choice, prompt: " Topic:", options: [bug, "{LONG}"]}}]'
    with pytest.raises(ConfigError) as err:
        run_job(compose_job(job(tiny_model, tmp_path, questions, "engine.max_model_len=64")))
    text = str(err.value)
    assert "decide.questions[0].options[1] (question 'topic'" in text
    assert "answer tokens" in text and "engine.max_model_len=64" in text
    assert not list((tmp_path / "out").glob("part-*.parquet"))  # no part of too_long rows


def test_the_cli_exits_2_naming_the_option_without_a_traceback(tiny_model, tmp_path):
    repeated = run_cli(job(tiny_model, tmp_path, '[{name: ok, kind: predicate, options: [yes, "yes"]}]'),
                       timeout=120)
    assert repeated.returncode == 2, repeated.stderr[-3000:]
    assert "decide.questions[0].options[1] of question 'ok'" in repeated.stderr
    questions = f'[{{name: topic, kind: choice, prompt: " Topic:", options: [bug, "{LONG}"]}}]'
    long = run_cli(job(tiny_model, tmp_path / "b", questions, "engine.max_model_len=64"), timeout=120)
    assert long.returncode == 2, long.stderr[-3000:]
    assert "decide.questions[0].options[1]" in long.stderr and "engine.max_model_len=64" in long.stderr
    assert "Traceback" not in repeated.stderr + long.stderr
