"""The files that shape a prompt (chat template, tokenizer, generation and processor config) in the model identity:
each by name and digest, so that a resume after one of them changed is refused like a changed model, while an
output made before they were recorded still resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchgen.errors import ResumeMismatchError
from batchgen.output.manifest import diff, model_identity
from batchgen.output.prompt_files import changed_files, prompt_identity
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, write_parquet

EDITS = {  # a file of the tiny model, and an edit to it that changes what a prompt becomes
    "chat_template.jinja": lambda text: text.replace("<|end|>", "</s>"),
    "tokenizer_config.json": lambda text: json.dumps({**json.loads(text), "add_bos_token": False}),
    "tokenizer.json": lambda text: text.replace('"<|end|>"', '"<|stop|>"', 1),
    "generation_config.json": lambda text: json.dumps({**json.loads(text), "eos_token_id": 7}),
}


@pytest.fixture
def model(tiny_model, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def edit(path: Path) -> str:
    """Apply EDITS[path.name] to the file; its old text."""
    old = path.read_text()
    path.write_text(EDITS[path.name](old))
    assert path.read_text() != old
    return old


def test_each_prompt_file_is_in_the_identity_by_name_and_content(model):
    before = prompt_identity(str(model))
    assert set(EDITS) <= set(before["prompt_files"]) and "model.safetensors" not in before["prompt_files"]
    assert model_identity(str(model))["prompt_files"] == before["prompt_files"]
    for name in EDITS:
        old = edit(model / name)
        assert changed_files(before, prompt_identity(str(model))) == [
            f"prompt_files.{name}: was {before['prompt_files'][name]}, "
            f"now {prompt_identity(str(model))['prompt_files'][name]}"]
        (model / name).write_text(old)
    (model / "preprocessor_config.json").write_text("{}")
    assert changed_files(before, prompt_identity(str(model))) == [
        f"prompt_files.preprocessor_config.json: was absent, now "
        f"{prompt_identity(str(model))['prompt_files']['preprocessor_config.json']}"]
    assert prompt_identity("org/some-model") == {} and model_identity("org/some-model") == {"model": "org/some-model"}


def test_a_resume_after_a_prompt_file_changed_is_refused_like_a_changed_model(model, tmp_path):
    """The model's chat template, tokenizer or generation config edited between a kill and its resume would mix two
    prompt formats in one output: refused (exit 2) naming the file; restored, the resume goes on."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": f"question {i}"} for i in range(4)])
    out = tmp_path / "out"
    cfg = compose_job(dummy_overrides(str(model), data, out, "dataset.system_prompt=be brief",
                                      "sampling.max_new_tokens=2", "run.rows_per_part=2"))
    assert run_job(cfg).state == "done"
    (out / "_SUCCESS").unlink()
    (out / "part-00001.parquet").unlink()  # as a run killed before its second part
    for name in EDITS:
        old = edit(model / name)
        with pytest.raises(ResumeMismatchError, match=rf"model\.prompt_files\.{name}: was '[0-9a-f]{{16}}', now"):
            run_job(cfg)
        (model / name).write_text(old)
    summary = run_job(cfg)
    assert summary.state == "done" and (out / "part-00001.parquet").exists()


def test_a_separate_tokenizer_directory_is_fingerprinted_too(model, tiny_model, tmp_path):
    weights = shutil.ignore_patterns("*.safetensors")
    tokenizer = Path(shutil.copytree(tiny_model, tmp_path / "tokenizer", ignore=weights))
    before = model_identity(str(model), str(tokenizer))
    assert before["tokenizer_files"] == before["prompt_files"]  # the same files, recorded for each directory
    edit(tokenizer / "chat_template.jinja")
    after = model_identity(str(model), str(tokenizer))
    assert diff({"model": before}, {"model": after}) == [
        f"model.tokenizer_files.chat_template.jinja: was {before['tokenizer_files']['chat_template.jinja']!r}, "
        f"now {after['tokenizer_files']['chat_template.jinja']!r}"]
    assert "tokenizer_files" not in model_identity(str(model), str(model))  # the model's own: recorded once


def test_an_output_made_before_prompt_files_were_recorded_resumes_on_what_it_recorded(model):
    new = model_identity(str(model))
    old = {k: v for k, v in new.items() if k != "prompt_files"}
    assert diff({"model": old}, {"model": new}) == []
