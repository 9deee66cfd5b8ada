"""Issue 28, round 2, the reader's cases: a Parquet row group is read once per run however many parts it holds
(case 14), and a saved JSONL input index is used only by a reader of the same shape (case 7)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.job import JobConfig
from batchgen.prompts.planner import Planner
from batchgen.reader import DatasetConfig, open_reader
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, run_cli, write_jsonl

# -- case 14: one large row group, many parts -------------------------------------------------------------------


def one_group(path, n: int):
    """`n` rows in a single row group (pyarrow's default up to about a million rows)."""
    pq.write_table(pa.table({"uid": [f"u{i:05d}" for i in range(n)], "prompt": corpus(n, seed=14)}), path,
                   row_group_size=n)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    return path


def planned_rows(path, rows_per_part: int, shard: int = 0, num_shards: int = 1, skip=frozenset()):
    """(the parts' rows as one table, rows the reader decoded) for one run of the planner over `path`."""
    cfg = JobConfig(name="m", dataset=DatasetConfig(path=str(path)))
    cfg.run.rows_per_part, cfg.run.shard, cfg.run.num_shards = rows_per_part, shard, num_shards
    reader = open_reader(cfg.dataset)
    parts = list(Planner(cfg, reader, renderer=None, tokenizer=None).parts(skip=set(skip)))
    return parts, reader.rows_read


def test_case14_one_row_group_read_once(tiny_model, tmp_path):
    data = one_group(tmp_path / "in.parquet", 50_000)
    whole = pq.read_table(data)
    parts, read = planned_rows(data, 64)  # the figure: 20,360,800 rows read (407x) before
    assert read <= 2 * 50_000, f"{read} rows read for 50000"
    assert [p.index for p in parts] == list(range(782)) and all(p.start == 64 * p.index for p in parts)
    assert pa.concat_tables(p.table for p in parts).equals(whole)
    assert sum((p.ids for p in parts), []) == [f"in.parquet:{i}" for i in range(whole.num_rows)]
    # a shard and a resume read at most the row group once, and get exactly their parts' rows
    shard, read = planned_rows(data, 64, shard=1, num_shards=3)
    assert read <= whole.num_rows and [p.index for p in shard] == list(range(1, 782, 3))
    assert all(p.table.equals(whole.slice(64 * p.index, 64)) for p in shard)
    rest, read = planned_rows(data, 64, skip=set(range(700)))
    assert read <= whole.num_rows and [p.index for p in rest] == list(range(700, 782))
    assert pa.concat_tables(p.table for p in rest).equals(whole.slice(700 * 64))
    # ranges that end mid-batch, one left half read, then one behind: each still exactly its rows
    reader = open_reader(DatasetConfig(path=str(data), batch_rows=50))
    assert pa.concat_tables(b.table for b in reader.iter_range(0, 64)).equals(whole.slice(0, 64))
    next(reader.iter_range(100, 164))  # its first batch decoded and handed out, the rest never asked for
    assert pa.concat_tables(b.table for b in reader.iter_range(164, 228)).equals(whole.slice(164, 64))
    assert pa.concat_tables(b.table for b in reader.iter_range(10, 20)).equals(whole.slice(10, 10))
    # a job's summary counts the same, and its output is that of one part holding the whole file
    small = tmp_path / "small.parquet"
    pq.write_table(whole.slice(0, 600), small, row_group_size=600)
    common = ("engine=dummy", "dataset.id_column=uid", "sampling.max_new_tokens=4")
    summary = run_job(compose_job(job_overrides(tiny_model, small, tmp_path / "a", *common, "run.rows_per_part=8")))
    assert summary.state == "done" and summary.rows_read <= 2 * 600, summary.rows_read
    run_job(compose_job(job_overrides(tiny_model, small, tmp_path / "b", *common, "run.rows_per_part=600")))
    assert read_output(tmp_path / "a").equals(read_output(tmp_path / "b"))


# -- case 7: a saved JSONL input index made by another reader ------------------------------------------------------


def test_case7_input_index_keyed_by_reader_shape(tiny_model, tmp_path):
    """`batchgen plan` saves the input's pass (column types, part marks) in output_dir; a job on the same input and
    output_dir under another dataset.format must not take it: it would read the lines under the other reader's
    columns (all null), or be refused for columns the file has."""
    data = write_jsonl(tmp_path / "req.jsonl", [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                                 "body": {"prompt": t, "max_tokens": 4}}
                                                for i, t in enumerate(corpus(6, seed=7))])
    per_format = {"jsonl": ["dataset.prompt_column=custom_id"], "openai_batch": []}

    def args(out, fmt):
        return job_overrides(tiny_model, data, out, "engine=dummy", "sampling.max_new_tokens=4",
                             f"dataset.format={fmt}", *per_format[fmt])

    for first, second in (("openai_batch", "jsonl"), ("jsonl", "openai_batch")):
        out = tmp_path / f"{first}-then-{second}"
        plan = run_cli(["plan", *args(out, first)])
        assert plan.returncode == 0, plan.stderr[-2000:]
        job = run_cli(args(out, second))
        assert job.returncode == 0, f"{first} plan, then {second} job: {job.stderr[-2000:]}"
        got = read_output(out)
        if second == "jsonl":  # every line's own columns, passed through as written
            assert got.column("url").to_pylist() == ["/v1/completions"] * 6
            assert [b["max_tokens"] for b in got.column("body").to_pylist()] == [4] * 6
        else:  # the requests: ids from custom_id, prompts from the bodies
            assert got.column("id").to_pylist() == [f"r{i}" for i in range(6)]
            assert got.column("error").to_pylist() == [None] * 6
        assert json.loads((out / "_input_index.json").read_text())["shape"]["format"] == second  # overwritten
    # an openai_batch index carries the file's endpoint: a shard starting mid-file judges its lines by the first
    # request's, as the pass did, not by its own first line
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [
        {"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x"}}])
    whole, shard = (open_reader(DatasetConfig(path=str(mixed), format="openai_batch")) for _ in range(2))
    whole.stride = shard.stride = 1
    assert shard.use_index(json.loads(json.dumps(whole.index())))
    assert "differs from the file's endpoint" in next(shard.iter_range(1, 2)).read_errors[0]
