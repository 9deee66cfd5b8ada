"""A new user's first hour: batchgen installed from a wheel runs a preset job and every command from any directory,
with the user's own presets beside the shipped ones; the console shows the bar, warnings and the summary, each error
once."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.docs  # the docs tier: make test-docs

PRESET = """# @package _global_
defaults:
  - override /dataset: jsonl
name: mine
dataset:
  template: "Answer briefly: {instruction}"
  id_column: id
sampling:
  max_new_tokens: 8
"""


def run(cmd: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ | env)
    assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """batchgen built as a wheel and installed into a fresh venv outside the checkout. Its dependencies come from
    the test's own environment through a .pth line (nothing is downloaded, and the checkout's editable install is
    not on that path: a .pth line adds a directory without running the .pth files in it)."""
    where = tmp_path_factory.mktemp("wheel")
    source = where / "source"  # the checkout's files only: a stale build/ there must not reach the wheel
    listed = run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard"], where)
    for name in listed.stdout.splitlines():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(where / "dist"),
         str(source)], where)
    wheel = next((where / "dist").glob("batchgen-*.whl"))
    venv = where / "venv"
    run([sys.executable, "-m", "venv", str(venv)], where)
    py = venv / "bin" / "python"
    target = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where).stdout
                  .strip())
    (target / "batchgen-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], where)
    return venv


def test_a_wheel_runs_a_preset_job_and_every_command_from_another_directory(installed, tiny_model, tmp_path):
    home = tmp_path / "somewhere"
    (home / "my-presets" / "job").mkdir(parents=True)
    (home / "my-presets" / "job" / "mine.yaml").write_text(PRESET)
    batchgen = str(installed / "bin" / "batchgen")
    located = run([str(installed / "bin" / "python"), "-c", "import batchgen; print(batchgen.__file__)"], home)
    assert str(installed) in located.stdout and str(REPO) not in located.stdout, located.stdout
    presets = run([str(installed / "bin" / "python"), "-c", "import batchgen.conf; print(batchgen.conf.__file__)"],
                  home).stdout  # the checkout's top-level conf/, shipped inside the package
    assert str(installed) in presets and str(REPO) not in presets, presets
    data = REPO / "data" / "demo" / "prompts.jsonl"
    job = [f"engine.model={tiny_model}", "engine.dtype=float32", f"dataset.path={data}", "dataset.limit=12",
           "run.rows_per_part=4", "output_dir=out"]
    # a shipped preset, from a directory with no conf/ in it
    done = run([batchgen, "job=demo", *job, "run.progress=false"], home)
    assert "batchgen: done: out" in done.stdout and "input: 12 rows read" in done.stdout
    # the user's own preset, by --config-dir, for the job and for plan alike
    mine = ["--config-dir", "my-presets", "job=mine", *job[:-1], "output_dir=mine"]
    planned = run([batchgen, "plan", *mine], home)
    assert "parts" in planned.stdout and (home / "mine" / "_plan.json").exists()
    run([batchgen, *mine, "run.progress=false"], home)
    rows = json.loads((home / "mine" / "_status.json").read_text())
    assert rows["state"] == "done" and rows["rows_done"] == 12
    assert "rows 12/12" in run([batchgen, "status", "out"], home).stdout
    run([batchgen, "report", "out"], home)
    assert (home / "out" / "_report.html").read_text().count("<svg") >= 3  # the plots, on the base install
    requires = run([str(installed / "bin" / "python"), "-c", "import importlib.metadata as m; "
                    "print('\\n'.join(m.requires('batchgen')))"], home).stdout.splitlines()
    assert any(r.startswith("matplotlib") and "extra" not in r for r in requires), requires
    assert "newline" in run([batchgen, "help", "dataset.template"], home).stdout  # the reference ships too
    for scheduled in ("nightly", "increment"):  # the scheduled jobs' commands ship (their example scripts need not)
        assert "docs/scheduled-jobs.md" in run([batchgen, scheduled, "--help"], home).stdout
    helped = run([batchgen, "--config-dir", "my-presets", "--help"], home).stdout
    assert "annotate, annotate_json, classify, decide, demo, mine" in helped


def test_the_console_shows_the_bar_warnings_and_the_summary_each_error_once(tiny_model, tmp_path):
    """The demo preset on the tiny model: no INFO line (engine internals go to the run's log file), no loading bar
    of transformers', input rows counted once; a job refused at its input prints its error once."""
    out = tmp_path / "out"
    done = run_cli(["job=demo", f"engine.model={tiny_model}", "engine.dtype=float32", f"output_dir={out}",
                    "dataset.limit=30", "run.rows_per_part=10"])
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "INFO" not in console and "Loading weights" not in console, console[-3000:]
    assert "input: 30 rows read" in done.stdout
    logs = list(out.glob("_logs/*/batchgen.log"))
    assert logs and "INFO" in logs[0].read_text()  # what the console no longer shows is in the run's log
    refused = run_cli(["job=demo", f"engine.model={tiny_model}", f"output_dir={tmp_path / 'refused'}",
                       "dataset.prompt_column=nope", "dataset.template=null"])
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if "column 'nope' not found" in line]
    assert len(lines) == 1, refused.stderr[-3000:]
