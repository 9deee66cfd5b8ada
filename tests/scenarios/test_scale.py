"""Scaling out on one machine: a Slurm-style array of shards as separate processes (some concurrent), each reading
only its own parts of a Parquet input, then `batchgen finalize`; shard defaults from the Slurm environment. On
engine=dummy: which rows each shard reads and whether the shards' parts equal one process's are the pipeline's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.run.runner import run_job
from tests.conftest import REPO, compose_job, corpus, dummy_overrides, read_output, run_cli

ROWS, PART = 40, 8  # 5 parts: shard 0 of 3 has parts 0 and 3, shard 1 parts 1 and 4, shard 2 part 2


@pytest.fixture
def sharded_input(tmp_path):
    path = tmp_path / "in.parquet"
    table = pa.table({"uid": [f"u{i:03d}" for i in range(ROWS)], "prompt": corpus(ROWS, seed=6)})
    pq.write_table(table, path, row_group_size=PART)  # a row group per part: a shard's reads are exactly its rows
    return path


def args(model, data, out):
    return dummy_overrides(model, data, out, "dataset.id_column=uid", f"run.rows_per_part={PART}",
                           "sampling.max_new_tokens=6")


def shard(model, data, out, k):
    """One array task: its share from the Slurm environment, not from run.shard / run.num_shards."""
    env = os.environ | {"SLURM_ARRAY_TASK_ID": str(10 + k), "SLURM_ARRAY_TASK_MIN": "10",
                        "SLURM_ARRAY_TASK_COUNT": "3", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchgen", *args(model, data, out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows_read(stdout: str) -> int:
    return int(re.search(r"input: (\d+) rows read", stdout).group(1))


def test_three_shards_read_only_their_parts_and_finalize_equals_one_process(tiny_model, sharded_input, tmp_path):
    single = tmp_path / "single"
    run_job(compose_job(args(tiny_model, sharded_input, single)))
    out = tmp_path / "sharded"
    first = [shard(tiny_model, sharded_input, out, k) for k in (0, 1)]  # two shards at once
    outputs = [p.communicate(timeout=300) for p in first]
    assert [p.returncode for p in first] == [0, 0], [e[-2000:] for _, e in outputs]
    assert [rows_read(o) for o, _ in outputs] == [2 * PART, 2 * PART]  # its two parts, never the others
    early = run_cli(["finalize", str(out)])
    assert early.returncode == 1 and "1 of 5 parts missing: 2 (shard 2)" in early.stderr, early.stderr
    assert not (out / "_SUCCESS").exists()
    last = shard(tiny_model, sharded_input, out, 2)
    stdout, stderr = last.communicate(timeout=300)
    assert last.returncode == 0, stderr[-2000:]
    assert rows_read(stdout) == PART and (out / "_SUCCESS").exists()  # the last shard to finish completes it
    (out / "_SUCCESS").unlink()
    done = run_cli(["finalize", str(out)])
    assert done.returncode == 0 and "all 5 parts committed" in done.stdout and (out / "_SUCCESS").exists()
    assert read_output(out).equals(read_output(single))


def test_a_resume_reads_only_the_parts_still_to_do(tiny_model, sharded_input, tmp_path):
    out = tmp_path / "out"
    run_job(compose_job(args(tiny_model, sharded_input, out)))
    for k in (1, 3):
        (out / f"part-{k:05d}.parquet").unlink()
    (out / "_SUCCESS").unlink()
    summary = run_job(compose_job(args(tiny_model, sharded_input, out)))
    assert summary.rows_read == 2 * PART and summary.state == "done"


def test_shards_default_from_the_slurm_array_environment(tiny_model, sharded_input, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "8")
    cfg = compose_job(args(tiny_model, sharded_input, tmp_path / "o"))
    assert (cfg.run.shard, cfg.run.num_shards) == (3, 8)
    explicit = compose_job(args(tiny_model, sharded_input, tmp_path / "o") + ["run.shard=0", "run.num_shards=1"])
    assert (explicit.run.shard, explicit.run.num_shards) == (0, 1)  # set keys win over the environment
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert (compose_job(args(tiny_model, sharded_input, tmp_path / "o")).run.num_shards) == 1


def test_finalize_refuses_a_directory_without_a_run(tmp_path):
    proc = run_cli(["finalize", str(tmp_path)])
    assert proc.returncode == 2 and "no batchgen run here" in proc.stderr


def test_jsonl_shards_read_only_their_parts_after_the_first_made_the_index(tiny_model, tmp_path):
    """The first shard's pass over every line (types, part marks) is saved beside the output; the other shards
    and resumes take it and read only their own parts' lines."""
    from tests.conftest import write_jsonl

    data = write_jsonl(tmp_path / "in.jsonl", [{"uid": f"j{i:03d}", "prompt": p} for i, p in
                                               enumerate(corpus(ROWS, seed=6))])
    single = tmp_path / "single"
    run_job(compose_job(args(tiny_model, data, single)))
    out = tmp_path / "sharded"
    summaries = [run_job(compose_job(args(tiny_model, data, out) + [f"run.shard={k}", "run.num_shards=3"]))
                 for k in (0, 1, 2)]
    assert (out / "_input_index.json").exists()
    assert [s.rows_read for s in summaries] == [2 * PART, 2 * PART, PART]  # own parts' rows only, each row once
    assert [s.rows_typed for s in summaries] == [ROWS, 0, 0]  # the first typed every line; the others took its pass
    assert f"input: {2 * PART} rows read\n" in summaries[0].render()  # the typing pass goes to the log
    assert read_output(out).equals(read_output(single))
    (out / "part-00003.parquet").unlink()
    (out / "_SUCCESS").unlink()
    resumed = run_job(compose_job(args(tiny_model, data, out) + ["run.shard=0", "run.num_shards=3"]))
    assert resumed.rows_read == PART and read_output(out).equals(read_output(single))
