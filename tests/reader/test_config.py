"""reader/config.py: DatasetConfig.problems(), the checks on dataset.* that need no file opened; each message names
its key."""

from __future__ import annotations

import importlib.util

import pytest

from batchgen.reader import DatasetConfig


def test_a_config_with_a_path_that_exists_and_the_defaults_has_no_problem(tmp_path):
    assert DatasetConfig(path=str(tmp_path)).problems() == []
    edges = DatasetConfig(path=str(tmp_path), limit=0, verify="footers", batch_rows=1, max_line_bytes=1)
    assert edges.problems() == []


@pytest.mark.parametrize("path", ["???", "", None])
def test_a_missing_path_is_named(path):
    assert DatasetConfig(path=path).problems() == ["dataset.path is required (a file, directory, glob or URL)"]


def test_every_bad_value_is_one_problem_naming_its_key_and_the_value(tmp_path):
    cfg = DatasetConfig(path=str(tmp_path), format="csv", limit=-1, batch_rows=0, verify="all", max_line_bytes=0,
                        template="Q: {q}", messages_column="messages", choice_column="c", schema_column="s")
    assert cfg.problems() == [
        "dataset.format must be one of auto, parquet, jsonl, hf, openai_batch (got 'csv')",
        "dataset.limit must be >= 0 or null (got -1)",
        "dataset.batch_rows must be >= 1 (got 0)",
        "dataset.verify must be one of footers, pages (got 'all')",
        "dataset.max_line_bytes must be >= 1 (got 0)",
        "dataset.template and dataset.messages_column are exclusive: set one of them",
        "dataset.choice_column and dataset.schema_column are exclusive: a row has one constraint",
    ]


def test_a_local_path_that_does_not_exist_is_named_unless_a_glob_or_a_hub_id(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert DatasetConfig(path=str(missing)).problems() == [f"dataset.path: no such file or directory: {missing}"]
    assert DatasetConfig(path=str(tmp_path / "*.jsonl")).problems() == []  # a glob: matched when the files are read
    assert DatasetConfig(path=str(tmp_path / "part-[0-9].parquet")).problems() == []
    assert DatasetConfig(path="org/some-dataset", format="hf").problems() == []  # a hub id, not a local path


def test_a_url_is_checked_for_its_filesystem_not_for_the_file():
    assert DatasetConfig(path="memory://bucket/never-written.jsonl").problems() == []
    assert DatasetConfig(path="nosuchfs://bucket/x.jsonl").problems() == [
        "dataset.path: unknown URL scheme nosuchfs:// (fsspec knows no such filesystem)"]


def test_a_url_whose_filesystem_package_is_not_installed_names_the_scheme():
    if importlib.util.find_spec("wandbfs") is not None:
        pytest.skip("wandbfs is installed: wandb:// has its filesystem")
    (problem,) = DatasetConfig(path="wandb://project/x.jsonl").problems()
    assert problem.startswith("dataset.path: wandb:// needs a package that is not installed: ")
    assert "wandbfs" in problem


@pytest.mark.parametrize("template", ["prompts/q.txt", "q.TXT", "prompt.md", "chat.jinja", "t.j2", "dir/question"])
def test_a_template_that_looks_like_a_path_is_refused_as_the_text_it_would_be(tmp_path, template):
    problems = DatasetConfig(path=str(tmp_path), template=template).problems()
    assert len(problems) == 1 and problems[0].startswith(f"dataset.template={template!r} looks like a file's path")
    assert "a format string with {column} placeholders" in problems[0]


def test_a_template_naming_an_existing_file_is_refused_and_text_or_placeholders_are_not(tmp_path):
    existing = tmp_path / "question"
    existing.write_text("Summarize:\n{text}")
    assert DatasetConfig(path=str(tmp_path), template=str(existing)).problems()[0].startswith("dataset.template=")
    for template in ("{text}", "See docs/{path}.md", "Answer yes or no.", "Hello", "Summarize:\n{text}", ""):
        assert DatasetConfig(path=str(tmp_path), template=template).problems() == [], template


def test_the_command_line_refuses_a_template_path_with_exit_2(tiny_model, tmp_path):
    from tests.conftest import dummy_overrides, run_cli, write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    (tmp_path / "q.txt").write_text("Summarize:\n{text}")
    refused = run_cli(dummy_overrides(tiny_model, data, tmp_path / "out", f"dataset.template={tmp_path}/q.txt"))
    assert refused.returncode == 2 and "dataset.template=" in refused.stderr, refused.stderr
    assert "{column} placeholders" in refused.stderr and not (tmp_path / "out").exists()
