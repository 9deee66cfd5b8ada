"""The command line in a subprocess: exit codes before any model loads, a SIGKILL mid-job and resume,
the lock, and `batchgen status`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, corpus, dummy_overrides, job_overrides, read_output, run_cli, write_parquet


def test_config_errors_exit_2_naming_the_key_before_the_model_loads(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"text": "a"}])
    base = job_overrides(tiny_model, data, tmp_path / "out")
    cases = {
        "dataset.prompt_column: column 'prompt' not found": [],
        "dataset.path: no such file": [f"dataset.path={tmp_path / 'missing.parquet'}"],
        "engine=nope: no such option (did you mean engine=openai?); choices: dummy, hf, openai, vllm": ["engine=nope"],
        "engine.model: no such model directory": [f"engine.model={tmp_path / 'no-model'}",
                                                  "dataset.prompt_column=text"],
        "sampling.top_p must be in (0, 1]": ["sampling.top_p=2.0", "dataset.prompt_column=text"],
        "bogus: no such config key": ["bogus=1"],
        "engine.device must be auto, cpu, cuda or cuda:N (got 'gpu')": ["engine.device=gpu"],
        "has no weight files": [f"engine.model={tmp_path}"],  # a directory without weights
        "dataset.path: gs:// needs a package": ["dataset.path=gs://bucket/in.parquet"],  # gcsfs is not installed
        "output_dir: gs:// needs a package": ["output_dir=gs://bucket/out"],
        "name is required": ["~name"],
        "output_dir: the disk holding /proc has 0 MiB free": ["output_dir=/proc/out"],
    }
    if not os.access("/proc/sys", os.W_OK):  # read-only even for root where /proc/sys is mounted so
        cases["output_dir: /proc/sys is not writable"] = ["output_dir=/proc/sys/out"]
    (tmp_path / "config.json").write_text("{}")
    for expected, extra in cases.items():
        proc = run_cli(base + extra, timeout=120)
        assert proc.returncode == 2, (expected, proc.stderr[-2000:])
        assert expected in proc.stderr, (expected, proc.stderr[-2000:])
        # the engine is built only after the manifest is written: no manifest, no model load
        assert not (tmp_path / "out" / "_manifest.json").exists() and "Loading weights" not in proc.stderr


def test_validation_reports_every_problem_at_once(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    proc = run_cli(job_overrides(tiny_model, data, tmp_path / "out", "sampling.n=0", "run.too_long=cut",
                                 "engine.quantization=int3"), timeout=120)
    assert proc.returncode == 2
    for key in ("sampling.n", "run.too_long", "engine.quantization"):
        assert key in proc.stderr
    # a bad path, a bad model and a bad sampling.n together; then several unknown keys: each set in one run,
    # one line per problem, and nothing written (no output_dir, no _logs)
    out = tmp_path / "never"
    proc = run_cli(job_overrides(tiny_model, tmp_path / "nope.parquet", out, f"engine.model={tmp_path / 'm'}",
                                 "sampling.n=0"), timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("batchgen: error: ")]
    assert proc.returncode == 2 and len(lines) == 3, proc.stderr
    assert [x.removeprefix("batchgen: error: ").split(" ")[0].rstrip(":") for x in lines] == [
        "engine.model", "dataset.path", "sampling.n"]
    proc = run_cli(job_overrides(tiny_model, data, out, "engine.dtyp=float32", "run.shrd=1"), timeout=120)
    assert proc.returncode == 2 and "did you mean engine.dtype?" in proc.stderr and "did you mean run.shard?" in \
        proc.stderr
    assert not out.exists()


def wait_for(path, proc, timeout=240.0):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "timed out waiting for " + str(path)
        time.sleep(0.02)


def test_sigkill_after_first_part_then_resume_equals_an_uninterrupted_run(tiny_model, tmp_path):
    rows = [{"uid": f"row-{i}", "prompt": t} for i, t in enumerate(corpus(120, seed=4))]
    data = write_parquet(tmp_path / "in.parquet", rows)
    extra = ("dataset.id_column=uid", "run.rows_per_part=10", "sampling=sample", "sampling.max_new_tokens=24",
             "sampling.ignore_eos=true", "engine.max_batch_size=2")
    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "batchgen", *job_overrides(tiny_model, data, killed, *extra)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(killed / "part-00000.parquet", proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    parts_at_kill = len(list(killed.glob("part-*.parquet")))
    assert not (killed / "_SUCCESS").exists() and parts_at_kill < 12
    resumed = run_cli(job_overrides(tiny_model, data, killed, *extra))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    clean = run_cli(job_overrides(tiny_model, data, tmp_path / "clean", *extra))
    assert clean.returncode == 0, clean.stderr[-3000:]
    got, want = read_output(killed), read_output(tmp_path / "clean")
    ids = got.column("id").to_pylist()
    assert sorted(ids) == sorted(r["uid"] for r in rows) and len(set(ids)) == len(ids)
    assert got.drop_columns(["seed"]).equals(want.drop_columns(["seed"]))
    assert got.column("seed").to_pylist() == want.column("seed").to_pylist()
    assert not list(killed.glob(".*tmp*"))  # a temp file of the killed run may stay hidden, never final
    print(f"killed with {parts_at_kill} of 12 parts committed; resumed to 120 rows, identical to a clean run")


def test_second_writer_is_refused_and_a_dead_holder_lock_is_taken_over(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(60)])
    out = tmp_path / "out"
    # one row at a time, 600 tokens each: the first run must outlive the second's start-up (60 x 160 tokens took
    # under 3 s on the Zen 5 EPYC)
    extra = ("run.rows_per_part=5", "sampling.max_new_tokens=600", "sampling.ignore_eos=true",
             "engine.max_batch_size=1")
    first = subprocess.Popen([sys.executable, "-m", "batchgen", *job_overrides(tiny_model, data, out, *extra)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(out / "_lock.holder.json", first)
    logs = {p: p.stat().st_mtime_ns for p in (out / "_logs").rglob("*") if p.is_file()}
    second = run_cli(job_overrides(tiny_model, data, out, *extra), timeout=120)
    assert second.returncode == 2 and f"pid {first.pid}" in second.stderr
    assert all(p.stat().st_mtime_ns == t for p, t in logs.items() if p.suffix == ".yaml")  # the live run's logs
    assert len(list((out / "_logs").iterdir())) == 1  # the refused writer's log folder went with it
    status = run_cli(["status", str(out)], timeout=60)
    assert status.returncode == 0 and f"held by pid {first.pid}" in status.stdout
    assert "stopped (no live writer)" not in status.stdout
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    # the takeover resumes with the batch open (batch sizes are not part of the run's fingerprint): seconds, not 30
    third = run_cli(job_overrides(tiny_model, data, out, *extra[:-1], "engine.max_batch_size=64"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert read_output(out).num_rows == 60
    status = run_cli(["status", str(out)], timeout=60)
    assert "complete" in status.stdout and "no run holds the lock" in status.stdout
    for lock in out.glob("_lock*"):
        lock.unlink()
    assert run_cli(["status", str(out)], timeout=60).returncode == 0 and not list(out.glob("_lock*"))  # reads only


def test_a_refused_run_writes_nothing_into_the_output_it_was_refused(tiny_model, tmp_path):
    """Another job pointed at a finished job's output_dir is refused (exit 2, the manifest's differences named), and
    leaves the output as it was: no `_logs/<time>` folder of its own among the first job's (it left one before)."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(4)])
    out = tmp_path / "out"
    first = run_cli(dummy_overrides(tiny_model, data, out), timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p.relative_to(out): p.is_dir() or p.stat().st_mtime_ns for p in out.rglob("*")}
    other = run_cli(dummy_overrides(tiny_model, data, out, "sampling.max_new_tokens=3"), timeout=120)
    assert other.returncode == 2 and "holds a run made from a different input, model or config" in other.stderr
    assert {p.relative_to(out): p.is_dir() or p.stat().st_mtime_ns for p in out.rglob("*")} == before  # files


def test_the_cli_explains_itself():
    """`batchgen --help` lists every command and every config group's options; each command has its own --help;
    `--version` is batchgen's, not Hydra's."""
    from batchgen.commands.cli import COMMANDS
    from batchgen.commands.compose import GROUPS, group_options
    from batchgen.version import __version__

    shown = run_cli(["--help"])
    assert shown.returncode == 0, shown.stderr
    for name, line in COMMANDS.items():
        assert f"  {name:<9} {line}" in shown.stdout
    for group in GROUPS:
        assert f"  {group:<9} {', '.join(group_options(group))}" in shown.stdout
    assert "hf, openai, vllm" in shown.stdout.replace("dummy, ", "") and "demo" in shown.stdout
    version = run_cli(["--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"batchgen {__version__}"
    for name in COMMANDS:
        helped = run_cli([name, "--help"])
        assert helped.returncode == 0 and f"batchgen {name}" in helped.stdout, (name, helped.stderr[-2000:])
    wrong = run_cli(["plan", "--calibrat"])
    assert wrong.returncode == 2 and "unknown option --calibrat" in wrong.stderr


def test_config_mistakes_are_named_with_what_to_do(tiny_model, tmp_path):
    """A misspelt group option lists the options; a value of the wrong type keeps its reason; a value Hydra's grammar
    cannot read names its key and the quoting that works (and that quoting does work)."""
    from batchgen.commands.compose import compose_checked
    from batchgen.errors import ConfigError

    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    base = job_overrides(tiny_model, data, tmp_path / "o")
    cases = {"sampling=greedyy": "sampling=greedyy: no such option (did you mean sampling=greedy?); choices: greedy, "
                                 "sample",
             "sampling.temperature=hot": "Value 'hot' of type 'str' could not be converted to Float",
             "dataset.system_prompt=Be brief Ω {x}": "dataset.system_prompt: Hydra's override grammar cannot read "
                                                     "this value unquoted"}
    for override, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            compose_checked([*base, override])
        assert len(err.value.problems) == 1 and expected in err.value.problems[0], err.value.problems
    advice = err.value.problems[0].split("shell's quotes: '")[1].split("', or")[0]
    assert advice == 'dataset.system_prompt="Be brief Ω {x}"'
    assert compose_checked([*base, advice]).dataset.system_prompt == "Be brief Ω {x}"


def test_cfg_job_shows_the_text_keys_as_the_job_uses_them():
    """`--cfg job` prints a stop string written `\\n` as the newline the job stops at and one written `\\\\n` as a
    backslash and an n (YAML's double quotes say which), as validate makes them (texts.py)."""
    proc = run_cli(["job=demo", 'sampling.stop=["\\n","\\\\n"]', "--cfg", "job"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '  stop:\n  - "\\n"\n  - "\\\\n"\n' in proc.stdout
    assert '  template: "{instruction}\\n\\n{input}"\n' in proc.stdout
    assert "output_dir: data/outputs/${name}" in proc.stdout
