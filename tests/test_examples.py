"""Every shell command shown in README.md and docs/*.md runs as written, with the tiny model in place of the real
model the docs name and small local files in place of the data they name (the paths only; every key and value the
user would type is kept). A command that needs what a test machine lacks (a GPU, a Slurm or Ray cluster, a bucket,
cron, a second venv) is listed in NOT_HERE with the test that covers it instead. A new example fails this test
until it is added to one of the two tables: the docs cannot hold a command nobody ran. docs/recipes.md is run
differently: as written, paths and model included, in a fresh `git clone` of the repository (CLONED)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, corpus

pytestmark = pytest.mark.docs  # the docs tier: make test-docs

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Commands that cannot run here, by their first words, with where they are covered instead.
NOT_HERE = {
    "make demo": "the README's first command: CI runs `make test`; the demo job is test_first_hour's",
    "make test": "CI runs it",
    "pip install 'batchgen[vllm]'": "an install on a GPU machine",
    "batchgen job=annotate engine=vllm": "a GPU fleet (tensor_parallel_size=4); the vLLM tier runs engine=vllm",
    "python3 -m venv .venv-vllm": "the vLLM tier's own venv (`make test-vllm`)",
    ".venv-vllm/bin/pip": "the vLLM tier's own venv (`make test-vllm`)",
    "VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/batchgen": "the vLLM tier (tests/vllm)",
    "bash scripts/gpu_wheels.sh": "the GPU check, on a lent GPU machine",
    "bash scripts/gpu_check.sh": "the GPU check, on a lent GPU machine",
    "30 2 * * *": ("a crontab line: batchgen increment and nightly, and jobs/increment.sh, nightly.sh under env -i, "
                   "run in tests/commands/test_scheduled.py"),
    "duckdb -c": ("the duckdb CLI: the queries run through duckdb's Python API in tests/scenarios/test_increments.py "
                  "and tests/engines/hf/test_decide.py"),
    "sbatch": "a Slurm cluster: jobs/slurm/*.sh run in tests/scenarios/test_jobs.py",
    "batchgen job=annotate launcher=ray launcher.address=auto": "an existing Ray cluster; the local one runs here",
    "vllm serve": "a vLLM server: the vLLM tier starts one (tests/vllm_tier/test_vllm_server.py)",
    "batchgen job=annotate engine=openai": ("an endpoint: tests/engines/endpoint/test_engine_openai.py runs the "
                                            "engine against a real model behind an OpenAI-compatible server, the "
                                            "vLLM tier against vllm serve"),
    "export OPENAI_API_KEY": "a hosted API's key",
}

# Where the docs name data or a model this machine does not have: the local stand-in (`{x}` is filled in below).
PATHS = {
    "engine.model": "{model}",
    "dataset.path=s3://bucket/docs/*.parquet": "docs/*.parquet",  # S3 itself: tests/output/test_s3.py
}

# Run as written (their paths and model too) in a fresh clone of the repository, commands and Python blocks in order
CLONED = ("recipes.md",)

# Appended to every job so that each runs in seconds (a key the command sets keeps the command's value).
SMALL = {"dataset.limit": "6", "sampling.max_new_tokens": "6", "run.progress": "false", "engine.dtype": "float32"}


def commands(path: Path) -> list[str]:
    """The shell commands of a file's ```bash blocks."""
    return [step for kind, step in steps(path) if kind == "bash"]


def steps(path: Path) -> list[tuple[str, str]]:
    """("bash", command) and ("python", code) of a file's ```bash and ```python blocks, in document order."""
    out = []
    for lang, block in re.findall(r"```(bash|sh|python)\n(.*?)```", path.read_text(), re.S):
        out += [("python", block)] if lang == "python" else [("bash", c) for c in block_commands(block)]
    return out


def block_commands(block: str) -> list[str]:
    """A ```bash block's commands: continued lines joined, a quoted value spanning lines kept whole (a
    `duckdb -c "..."`, a `python -c "..."`), comments and blank lines dropped."""
    out, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line.strip()
        if not pending or pending.startswith("#"):
            pending = ""
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(pending)
        pending = ""
    return out


def not_here(command: str) -> bool:
    return any(command.startswith(prefix) for prefix in NOT_HERE)


def workspace(root: Path, model: str) -> None:
    """The files the examples name, small: the demo data, a demo model (the tiny one), tickets, questions, a
    Hugging Face dataset on disk, an OpenAI batch file, Parquet documents."""
    shutil.copytree(REPO / "data" / "demo", root / "data" / "demo")
    (root / "data" / "models").mkdir()
    (root / "data" / "models" / "demo-llama").symlink_to(model)
    (root / "tickets").mkdir()
    shutil.copy(REPO / "data" / "demo" / "tickets.parquet", root / "tickets" / "tickets.parquet")
    lines = corpus(8, seed=3)
    (root / "data" / "questions.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in lines))
    (root / "docs").mkdir()
    pq.write_table(pa.table({"doc_id": [f"d{i}" for i in range(8)], "text": lines, "lang": ["en"] * 8}),
                   root / "docs" / "a.parquet")
    requests = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "messages": [{"role": "user", "content": q}], "max_tokens": 6}}
                for i, q in enumerate(lines)]
    (root / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"prompt": lines})}).save_to_disk(str(root / "my_dataset"))


def localized(command: str, model: Optional[str]) -> list[str]:
    """The command's words with the stand-ins in place (none without a `model`: as written) and SMALL appended;
    `batchgen` and `python` run by this interpreter."""
    words = shlex.split(command, comments=True)
    out = []
    for word in words:
        key = word.split("=", 1)[0]
        if model is None:
            pass
        elif key == "engine.model":
            word = f"engine.model={model}"
        elif word in PATHS:
            word = f"dataset.path={PATHS[word]}"
        elif key == "dataset.path" and word.split("=", 1)[1].startswith("/data/"):
            word = f"dataset.path={Path(word.split('=', 1)[1]).name}"
        elif word == "...":  # the docs' "and the rest of the job's keys"
            continue
        out.append(word)
    if out[0] == "batchgen":
        sub = out[1] if len(out) > 1 and out[1] in ("status", "retry", "report", "plan", "finalize", "view",
                                                    "head") else None
        if sub in (None, "plan", "retry"):
            keys = {w.split("=", 1)[0] for w in out}
            out += [f"{k}={v}" for k, v in SMALL.items() if k not in keys
                    and not (sub == "retry" and k == "dataset.limit")]
        return [sys.executable, "-m", "batchgen", *out[1:]]
    if out[0] == "python":
        return [sys.executable, *out[1:]]
    raise AssertionError(f"no way to run {command!r}: add it to NOT_HERE or teach localized()")


def test_every_documented_command_runs_as_written(tiny_model, tmp_path):
    """Each document's commands in order, in a workspace of its own (a document's commands may build on each other:
    a job, then its retry, then its status)."""
    ran, skipped = [], []
    for path in DOCS:
        if path.name in CLONED:  # test_the_recipes_run_as_written_from_a_fresh_clone
            skipped += [c for c in commands(path) if not_here(c)]
            continue
        home = tmp_path / path.stem
        workspace(home, tiny_model)
        for command in commands(path):
            if not_here(command):
                skipped.append(command)
                continue
            argv = localized(command, tiny_model)
            done = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (f"{path.name}: {command}", argv, done.stdout[-2000:], done.stderr[-3000:])
            ran.append(command)
    assert len(ran) >= 12, ran
    unused = [prefix for prefix in NOT_HERE if not any(c.startswith(prefix) for c in skipped)]
    assert not unused, f"NOT_HERE lists commands no longer in the docs: {unused}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_command_is_runnable_here_or_listed(path):
    """Without running anything: each command is one this test knows how to run, or NOT_HERE names it."""
    for command in commands(path):
        if not_here(command):
            continue
        assert shlex.split(command)[0] in ("batchgen", "python"), f"{path.name}: {command}"


def test_a_preset_template_with_an_openai_batch_input_is_one_error_naming_it(tiny_model, tmp_path):
    """job=demo's template with dataset.format=openai_batch: one problem, naming the template and where it came
    from, not a conflict with a messages_column the user never set."""
    from batchgen.commands.compose import compose_checked
    from batchgen.errors import ConfigError

    workspace(tmp_path, tiny_model)
    with pytest.raises(ConfigError) as err:
        compose_checked(["job=demo", "dataset.format=openai_batch", f"dataset.path={tmp_path / 'requests.jsonl'}",
                         f"engine.model={tiny_model}", f"output_dir={tmp_path / 'o'}"])
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith("dataset.template='{instruction}\\n\\n{input}' (set on the command line "
                                            "or by a preset such as job=demo) with dataset.format=openai_batch")


def fresh_clone(dest: Path) -> Path:
    """A `git clone` of this repository (its committed files only: no model, no output, no venv)."""
    done = subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (dest / "data" / "models").exists() and not (dest / "data" / "outputs").exists()
    return dest


def test_the_recipes_run_as_written_from_a_fresh_clone(tmp_path):
    """docs/recipes.md from top to bottom in a fresh clone: its commands and Python blocks as written, their paths
    and model included (the demo data and the demo model the recipes build), SMALL appended to each job for time.
    The recipes named files a clone lacks (data/questions.jsonl, tickets/, /models/...)."""
    home = fresh_clone(tmp_path / "clone")
    env = os.environ | {"PYTHONPATH": str(home)}  # the clone's batchgen, wherever a script runs from
    ran = []
    for kind, step in steps(REPO / "docs" / "recipes.md"):
        if kind == "bash" and not_here(step):
            continue
        argv = localized(step, None) if kind == "bash" else [sys.executable, "-c", step]
        done = subprocess.run(argv, cwd=home, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, (step, argv, done.stdout[-2000:], done.stderr[-3000:])
        ran.append((kind, step, done.stdout))
    assert sum(kind == "python" for kind, _, _ in ran) >= 4 and len(ran) >= 10, [s for _, s, _ in ran]
    printed = next(out for kind, step, out in ran if kind == "python" and "batchgen.generate(" in step)
    rows = eval(printed.strip().splitlines()[-1])  # noqa: S307 - the printed list of the recipe's own rows
    assert len(rows) == 2 and all(r["finish_reason"] in ("length", "stop") for r in rows)
    labels = next(out for kind, step, out in ran if kind == "python" and "pd.read_parquet" in step)
    assert "p_bug" in labels and '"' not in labels  # the labels as values, not JSON text
