"""The columns a job writes beside the contract's (run/preflight.py's checks, the planner's prompts): by default every
input column, the prompt's too, and the id once; `output.include_prompt` writes each row's prompt as the job rendered
it; a named passthrough column that is an output column is refused at start, naming both. engine=dummy throughout:
the columns are under test, not a model."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from batchgen.errors import ConfigError
from batchgen.run.preflight import HUB_TIMEOUT_S, load_tokenizer
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, read_output, run_cli, write_parquet

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


# -- a model named by a hub id: the hub unreachable, or HF_HUB_OFFLINE=1 -----------------------------------------


@pytest.fixture
def silent_hub():
    """An endpoint that takes connections and never answers (a hub behind a black hole), on this machine."""
    server = socket.create_server(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()


def closed_port() -> str:
    """An endpoint that refuses connections (no hub there)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        return f"http://127.0.0.1:{server.getsockname()[1]}"


def hub_cache(tmp_path, tiny_model: str, repo: str) -> str:
    """A Hugging Face cache that holds `repo` (the tiny model's files), laid out as huggingface_hub writes it."""
    snapshot = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    return str(tmp_path / "hub")


def hub_job(tiny_model, tmp_path, model: str, *extra: str) -> list[str]:
    data = tmp_path / "in.parquet"
    write_parquet(data, ROWS)
    return dummy_overrides(tiny_model, data, tmp_path / "out", f"engine.model={model}", "dataset.prompt_column=q",
                           "run.max_error_rate=1", "sampling.max_new_tokens=4", *extra)


def test_a_hub_id_job_where_the_hub_never_answers_is_refused_in_seconds_saying_what_to_do(tiny_model, tmp_path,
                                                                                           silent_hub):
    """The command line as a user types it: exit 2 with one clear line (a local path or HF_HUB_OFFLINE=1), none of
    huggingface_hub's retry warnings (a minute of them before this check)."""
    env = {"HF_ENDPOINT": silent_hub, "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    proc = run_cli(hub_job(tiny_model, tmp_path, "someorg/no-such-model"), timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert (f"engine.model=someorg/no-such-model is not a local directory, and the Hugging Face Hub ({silent_hub}) "
            f"cannot be reached from here (no answer in 2 s)") in proc.stderr
    assert "point engine.model at a local model directory" in proc.stderr and "HF_HUB_OFFLINE=1" in proc.stderr
    assert "Retrying" not in proc.stderr and proc.stderr.count("cannot be reached") == 1
    assert not (tmp_path / "out").exists()


def test_the_hub_check_takes_its_timeout_at_most_and_names_a_cached_copy(tiny_model, tmp_path, monkeypatch,
                                                                       silent_hub):
    from huggingface_hub import constants

    cfg = compose_job(hub_job(tiny_model, tmp_path, "org/tiny"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", silent_hub)
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"no answer in 2 s\), nor is org/tiny in the local cache"):
        load_tokenizer(cfg)
    assert time.perf_counter() - started < HUB_TIMEOUT_S + 1.5
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache(tmp_path, tiny_model, "org/tiny"))
    monkeypatch.setattr(constants, "ENDPOINT", closed_port())
    with pytest.raises(ConfigError) as refused:
        load_tokenizer(cfg)
    assert refused.value.problems[0].endswith(f"org/tiny is in the local cache ({constants.HF_HUB_CACHE}/models--org"
                                              f"--tiny/snapshots/0123abcd): set HF_HUB_OFFLINE=1 to use it, or point "
                                              f"engine.model there")


def test_hf_hub_offline_refuses_an_uncached_hub_id_at_once_and_runs_a_cached_one(tiny_model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = hub_cache(tmp_path, tiny_model, "org/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    with pytest.raises(ConfigError) as refused:
        load_tokenizer(compose_job(hub_job(tiny_model, tmp_path, "someorg/no-such-model")))
    assert refused.value.problems == [
        f"engine.model=someorg/no-such-model: HF_HUB_OFFLINE=1 is set and someorg/no-such-model is not in the local "
        f"Hugging Face cache ({cache}); point engine.model at a local model directory, download it where the hub is "
        f"reachable (`hf download someorg/no-such-model`), or unset HF_HUB_OFFLINE"]
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache, "HF_ENDPOINT": closed_port()}
    proc = run_cli(hub_job(tiny_model, tmp_path, "org/tiny"), timeout=120, env=env)  # the cached copy, run
    assert proc.returncode == 0, proc.stderr
    assert [r["error"] is None for r in read_output(tmp_path / "out").to_pylist()] == [True, True, False, True]
