"""The columns a job writes beside the contract's (run/preflight.py's checks, the planner's prompts): by default every
input column, the prompt's too, and the id once; `output.include_prompt` writes each row's prompt as the job rendered
it; a named passthrough column that is an output column is refused at start, naming both. engine=dummy throughout:
the columns are under test, not a model."""

from __future__ import annotations

import pytest

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, read_output, write_parquet

SAID = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "the river " * 90}], None,
        [{"role": "user", "content": "quiet night"}]]
ROWS = [{"uid": f"u{i}", "topic": f"t{i}", "q": m[0]["content"] if m else None, "messages": m}
        for i, m in enumerate(SAID)]


def job(model: str, tmp_path, name: str, *extra: str):
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, ROWS)
    return compose_job(dummy_overrides(model, data, tmp_path / name, "dataset.id_column=uid", "run.rows_per_part=2",
                                       "engine.max_model_len=128", "sampling.max_new_tokens=4", *extra))


def test_a_chat_job_writes_the_tokenizers_own_rendering_and_every_input_column_once(tiny_model, tokenizer, tmp_path):
    run_job(job(tiny_model, tmp_path, "chat", "dataset.messages_column=messages", "dataset.system_prompt=Be brief.",
                "output.include_prompt=true"))
    table = read_output(tmp_path / "chat")
    assert table.column_names[-4:] == ["rendered_prompt", "topic", "q", "messages"]  # the prompt's column too
    assert "uid" not in table.column_names and table.column("id").to_pylist() == [r["uid"] for r in ROWS]
    system = [{"role": "system", "content": "Be brief."}]
    want = [tokenizer.apply_chat_template(system + m, add_generation_prompt=True, tokenize=False) if m else None
            for m in SAID]
    assert table.column("rendered_prompt").to_pylist() == want  # the long one in full: the cut is the engine's
    assert table.column("error").to_pylist()[2] == "empty_prompt"


def test_a_template_job_writes_the_templates_text(tiny_model, tmp_path):
    run_job(job(tiny_model, tmp_path, "plain", 'dataset.template="Topic {topic}: {q}"', "output.include_prompt=true"))
    table = read_output(tmp_path / "plain")
    assert table.column("rendered_prompt").to_pylist() == [
        None if r["q"] is None else "Topic {topic}: {q}".format(**r) for r in ROWS]
    assert table.column_names.count("id") == 1 and "uid" not in table.column_names
    run_job(job(tiny_model, tmp_path, "off", "dataset.prompt_column=q"))
    assert read_output(tmp_path / "off").column_names[-3:] == ["topic", "q", "messages"]  # no rendered_prompt


def test_a_named_passthrough_column_that_is_an_output_column_is_refused_naming_both(tiny_model, tmp_path):
    write_parquet(tmp_path / "in.parquet", [{**r, "rendered_prompt": "mine", "seed": 1} for r in ROWS])
    with pytest.raises(ConfigError) as err:
        run_job(job(tiny_model, tmp_path, "out", "dataset.prompt_column=q", "output.include_prompt=true",
                    "dataset.passthrough_columns=[topic,rendered_prompt,seed]"))
    assert err.value.problems == [
        "dataset.passthrough_columns: input column 'rendered_prompt' collides with output.include_prompt's column "
        "'rendered_prompt'; rename it in the input, or leave it out of dataset.passthrough_columns",
        "dataset.passthrough_columns: input column 'seed' collides with the output column 'seed'; rename it in the "
        "input, or leave it out of dataset.passthrough_columns"]
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("key", ["min_p_column", "logit_bias_column", "repetition_penalty_column"])
def test_a_missing_per_row_sampling_column_is_refused_at_start_naming_its_key(tiny_model, tmp_path, key):
    with pytest.raises(ConfigError, match=rf"dataset.{key}: column 'nope' not found"):
        run_job(job(tiny_model, tmp_path, "out", f"dataset.{key}=nope"))
    assert not (tmp_path / "out" / "_manifest.json").exists()
