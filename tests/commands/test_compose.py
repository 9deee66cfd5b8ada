"""Composing the config (commands/compose.py): a key misspelt in a preset is named as one on the command line is, with
the preset's file, the full key, its likely spelling and `batchgen help KEY`; a key given without its section gets its
full name. In process (the CLI's own preflight), so that no test pays a Python start-up with torch."""

from __future__ import annotations

import pytest

from batchgen.commands import cli, compose
from batchgen.commands.compose import compose_checked
from batchgen.errors import ConfigError
from tests.conftest import dummy_overrides, write_parquet


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A user's config directory, named the way the command line names it (--config-dir), forgotten after the test."""
    monkeypatch.setattr(compose, "_config_dirs", [])
    monkeypatch.delenv(compose.USER_CONF_ENV, raising=False)
    (tmp_path / "conf" / "job").mkdir(parents=True)
    assert compose.take_config_dirs(["--config-dir", str(tmp_path / "conf"), "job=typo"]) == ["job=typo"]
    return tmp_path / "conf"


def test_a_typo_in_a_preset_names_its_file_the_full_key_and_batchgen_help(tiny_model, tmp_path, config_dir, capsys):
    preset = (config_dir / "job" / "typo.yaml").resolve()  # as the config directory is searched: resolved
    preset.write_text("# @package _global_\nname: typo\ndatset:\n  path: in.parquet\nsampling:\n  temprature: 0.3\n")
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    with pytest.raises(SystemExit) as exit_:
        cli.preflight(["job=typo", *dummy_overrides(tiny_model, data, tmp_path / "out")[1:]])
    assert exit_.value.code == 2
    said = capsys.readouterr().err.splitlines()
    assert said == [f"batchgen: error: {preset}: datset.path: no such config key (did you mean dataset.path?); see "
                    f"batchgen help dataset.path",
                    f"batchgen: error: {preset}: sampling.temprature: no such config key (did you mean "
                    f"sampling.temperature?); see batchgen help sampling.temperature"]  # every typo at once


def test_a_group_file_a_preset_picks_and_a_preset_without_its_package_line(tiny_model, tmp_path, config_dir):
    (config_dir / "dataset").mkdir()
    (config_dir / "dataset" / "mine.yaml").write_text("pth: in.parquet\n")
    (config_dir / "job" / "typo.yaml").write_text("# @package _global_\ndefaults:\n  - override /dataset: mine\n"
                                                  "name: typo\n")
    (config_dir / "job" / "bare.yaml").write_text("name: bare\n")
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    mine = (config_dir / "dataset" / "mine.yaml").resolve()
    for preset, expected in (("typo", f"{mine}: dataset.pth: no such config key (did you mean dataset.path?)"),
                             ("bare", "make its first line `# @package _global_`")):
        with pytest.raises(ConfigError) as err:
            compose_checked([f"job={preset}", *dummy_overrides(tiny_model, data, tmp_path / "out")[1:]])
        assert len(err.value.problems) == 1 and expected in err.value.problems[0], err.value.problems


def test_a_key_without_its_section_gets_its_full_name(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    base = dummy_overrides(tiny_model, data, tmp_path / "out")
    with pytest.raises(ConfigError) as err:
        compose_checked([*base, "temperature=0.3", "run.temprature=0.3", "format=jsonl", "zzqqxx=1",
                         "dataset.system_prompt=Be brief Ω {x}"])
    problems = err.value.problems
    assert problems[0] == ("dataset.system_prompt: Hydra's override grammar cannot read this value unquoted "
                           "(braces, quotes, backslashes or non-ASCII characters need quoting). Quote it for Hydra "
                           "inside the shell's quotes: 'dataset.system_prompt=\"Be brief Ω {x}\"', or set it in a "
                           "preset (a YAML file, DIR/job/NAME.yaml with --config-dir DIR), where any text goes")
    with pytest.raises(ConfigError) as err:
        compose_checked([*base, "temperature=0.3", "run.temprature=0.3", "format=jsonl", "zzqqxx=1"])
    problems = err.value.problems
    assert problems == [
        "temperature: no such config key (did you mean sampling.temperature?); see batchgen help sampling.temperature",
        "run.temprature: no such config key (did you mean sampling.temperature?); see batchgen help "
        "sampling.temperature",
        "format: no such config key (did you mean dataset.format or output.format?); see batchgen help format",
        "zzqqxx: no such config key; see batchgen help SECTION (dataset, engine, sampling, run, output, launcher)"]
    assert not [p for p in problems if "docs/" in p]  # a wheel install has no docs/ folder


def test_load_jobs_config_dir_serves_that_call_only(tiny_model, tmp_path, monkeypatch):
    """load_job(config_dir=DIR) finds DIR/job/NAME.yaml; a later load_job without config_dir no longer does (the
    directory stayed in the search path of every later call, and of the command line's composition, before)."""
    monkeypatch.setattr(compose, "_config_dirs", [])
    monkeypatch.delenv(compose.USER_CONF_ENV, raising=False)
    (tmp_path / "conf" / "job").mkdir(parents=True)
    (tmp_path / "conf" / "job" / "mine.yaml").write_text("# @package _global_\nname: mine\nsampling:\n"
                                                        "  max_new_tokens: 7\n")
    given = ["engine=dummy", f"engine.model={tiny_model}"]
    assert compose.load_job("mine", given, config_dir=str(tmp_path / "conf")).sampling.max_new_tokens == 7
    assert compose.user_conf_dirs() == []
    with pytest.raises(ConfigError, match="job=mine"):
        compose.load_job("mine", given)
