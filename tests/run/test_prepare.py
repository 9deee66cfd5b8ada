"""One job set-up (run.prepare) for every way to run a job: the local runner, the Ray driver and its workers, and
`batchgen plan` read the same parts of the same input; a resume writes the columns its output was started with."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from batchgen.commands.plan import measure
from batchgen.run.runner import run_job
from tests.conftest import compose_job, dummy_overrides, job_overrides, keyed_rows, write_jsonl, write_parquet

ROWS, PART = 10, 3


def parts_of(out) -> dict[str, list]:
    return {p.name: pq.read_table(p, columns=["id", "sample_index", "generation"]).to_pylist()
            for p in sorted(out.glob("part-*.parquet"))}


@pytest.mark.ray
def test_every_way_to_run_a_job_reads_the_same_parts(tiny_model, tmp_path):
    pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    data = write_jsonl(tmp_path / "in.jsonl", [{"uid": f"u{i}", "prompt": f"the river {i} " * (i % 4 + 1)}
                                              for i in range(ROWS)])

    def job(out, *extra):  # engine=dummy: no model, each generation a function of its request
        return compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "dataset.id_column=uid",
                                         f"run.rows_per_part={PART}", "sampling.max_new_tokens=4", *extra))

    run_job(job(tmp_path / "local"))
    plan, rows = measure(job(tmp_path / "plan"))
    run_job(job(tmp_path / "ray", "launcher=ray", "launcher.num_workers=1", "launcher.num_cpus=1"))
    local, ray = parts_of(tmp_path / "local"), parts_of(tmp_path / "ray")
    assert plan["parts"] == len(local) == -(-ROWS // PART) and plan["rows"] == ROWS == len(rows)
    assert ray == local  # the driver planned and the worker generated the same parts, row for row



def test_an_output_started_before_the_default_carried_every_column_resumes_with_its_own(tiny_model, tmp_path,
                                                                                         monkeypatch):
    """An output whose manifest records no passthrough columns was started by a batchgen whose default left the prompt
    column out and carried the id column beside `id`: its resume writes those columns, never a mix (the config hash
    is the same, so nothing else would tell). A new output records its columns."""
    from batchgen.run import prepare

    data = write_parquet(tmp_path / "in.parquet", [{**r, "topic": "t"} for r in keyed_rows(5, "u", seed=1)])

    def job(out):
        return compose_job(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=2",
                                           "sampling.max_new_tokens=3"))

    out = tmp_path / "old"
    with monkeypatch.context() as before:  # the batchgen before: its default's columns, none recorded
        before.setattr(prepare, "kept_passthrough", lambda output_dir, job: job.old_passthrough)
        run_job(job(out))
    manifest = json.loads((out / "_manifest.json").read_text())
    del manifest["passthrough"]
    (out / "_manifest.json").write_text(json.dumps(manifest))
    (out / "part-00002.parquet").unlink()
    (out / "_SUCCESS").unlink()
    assert run_job(job(out)).state == "done"
    names = [pq.read_schema(p).names[-2:] for p in sorted(out.glob("part-*.parquet"))]
    assert names == [["uid", "topic"]] * 3  # the resumed part as the others: uid kept, no prompt
    run_job(job(tmp_path / "new"))
    assert json.loads((tmp_path / "new" / "_manifest.json").read_text())["passthrough"] == ["prompt", "topic"]
    assert pq.read_schema(tmp_path / "new" / "part-00002.parquet").names[-2:] == ["prompt", "topic"]
