"""The streaming seam (batchgen/run/feed.py): parts in flight under a bounded look-ahead, results routed to their
parts whatever order the engine finishes them in, each part committed the moment its last sample is in."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest

import batchgen.engines
from batchgen.engines.base import EngineStats, Source, take
from batchgen.errors import ErrorRateExceeded
from batchgen.job import JobConfig
from batchgen.output import committer as committer_module
from batchgen.output.committer import Committer
from batchgen.output.rows.stats import PartStats
from batchgen.records import Request, Result
from batchgen.run import runner
from batchgen.run.feed import auto_lookahead, check_error_rate
from tests.conftest import (
    compose_job,
    corpus,
    dummy_overrides,
    job_overrides,
    read_output,
    run_cli,
    write_jsonl,
    write_parquet,
)


def text_of(request: Request) -> str:
    """What the fake engine generates: a function of the prompt and seed only."""
    return "g" + hashlib.sha1(repr((request.prompt_ids, request.seed)).encode()).hexdigest()[:12]


class LastInFirstOut:
    """An engine that takes everything the source gives, then finishes the newest request first, asking the
    source again after every result: parts finish out of order and several are in flight at once."""

    max_model_len = 2048

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.most_queued = 0
        self.keys_in_flight: set[int] = set()

    def identity(self) -> dict[str, Any]:
        return {"engine": "lifo", "dtype": None}

    def close(self) -> None:
        pass

    def stats(self) -> EngineStats:
        return EngineStats()

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        stack: list[Request] = []
        exhausted = False
        while True:
            if not exhausted:
                new, exhausted = take(source)
                for r in new:
                    assert r.key not in self.keys_in_flight  # keys are unique among the requests in flight
                    self.keys_in_flight.add(r.key)
                stack += new
                self.most_queued = max(self.most_queued, len(stack))
            if not stack:
                assert exhausted
                return
            r = stack.pop()
            self.keys_in_flight.discard(r.key)
            on_result(Result(key=r.key, text=text_of(r), finish_reason="length",
                             num_prompt_tokens=len(r.prompt_ids), num_generated_tokens=1))


def lifo_job(monkeypatch, engine: LastInFirstOut, tiny_model, data, out, *extra: str):
    monkeypatch.setattr(batchgen.engines, "build_engine", lambda cfg, tokenizer: engine)
    return runner.run_job(compose_job(job_overrides(tiny_model, data, out, "engine=dummy", "sampling=sample",
                                                    "sampling.n=2", *extra)))


def record_commits(monkeypatch) -> list[int]:
    order: list[int] = []
    real = committer_module.Committer.commit

    def commit(self, part, rows):
        order.append(part.index)
        return real(self, part, rows)

    monkeypatch.setattr(committer_module.Committer, "commit", commit)
    return order


@pytest.mark.parametrize("lookahead", ["0", "2", "null"])
def test_out_of_order_results_land_in_their_parts_in_input_order(tiny_model, tokenizer, tmp_path, monkeypatch,
                                                                   lookahead):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(23, seed=4)])
    engine = LastInFirstOut(max_batch_size=8)
    order = record_commits(monkeypatch)
    summary = lifo_job(monkeypatch, engine, tiny_model, data, tmp_path / "out", "run.rows_per_part=5",
                       f"run.lookahead_parts={lookahead}")
    resolved = {"0": 0, "2": 2, "null": auto_lookahead(8, 5, 2)}[lookahead]
    assert summary.state == "done" and sorted(order) == [0, 1, 2, 3, 4]
    assert summary.max_parts_in_flight == min(resolved + 1, 5)  # never more than 1 + look-ahead parts open
    assert engine.most_queued <= (resolved + 1) * 5 * 2
    if resolved:
        assert order != sorted(order)  # the newest part finished first: parts commit in any order
    rows = read_output(tmp_path / "out").to_pylist()
    assert [r["id"] for r in rows] == [f"in.parquet:{i}" for i in range(23) for _ in range(2)]
    assert [r["sample_index"] for r in rows] == [0, 1] * 23
    for row in rows:  # each sample's text is the one generated for its own prompt and seed
        prompt = corpus(23, seed=4)[int(row["id"].split(":")[1])]
        ids = tokenizer(prompt).input_ids
        assert row["generation"] == text_of(Request(key=0, prompt_ids=ids, params=None, seed=row["seed"]))


def test_the_status_lists_every_part_in_flight(tiny_model, tmp_path, monkeypatch):
    """While parts are in flight the heartbeat names each with its journaled samples; current_part is the oldest."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(12, seed=5)])
    out = tmp_path / "out"
    seen: list[dict] = []
    real_append = committer_module.Committer.commit

    def commit(self, part, rows):  # look at the status just before each commit
        seen.append(json.loads((out / "_status.json").read_text()))
        return real_append(self, part, rows)

    monkeypatch.setattr(committer_module.Committer, "commit", commit)
    lifo_job(monkeypatch, LastInFirstOut(max_batch_size=4), tiny_model, data, out, "run.rows_per_part=3",
             "run.lookahead_parts=3")
    assert max(len(s["parts_in_flight"]) for s in seen) == 4
    for status in seen:
        flight = status["parts_in_flight"]
        assert [p["index"] for p in flight] == sorted(p["index"] for p in flight)
        assert status["current_part"] == flight[0]


def test_a_stop_with_several_parts_in_flight_keeps_every_journal_and_the_resume_reuses_them(
        tiny_model, tmp_path, monkeypatch):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(20, seed=6)])
    out = tmp_path / "out"

    class DiesAfter(LastInFirstOut):
        def __init__(self, results: int):
            super().__init__(max_batch_size=8)
            self.left = results

        def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
            def counted(result: Result) -> None:
                if self.left == 0:
                    raise RuntimeError("engine died")
                self.left -= 1
                on_result(result)
            super().stream(source, counted)

    with pytest.raises(RuntimeError, match="engine died"):
        lifo_job(monkeypatch, DiesAfter(13), tiny_model, data, out, "run.rows_per_part=4", "run.lookahead_parts=3")
    journals = sorted(out.glob("_part-*.journal"))
    committed = sorted(out.glob("part-*.parquet"))
    assert len(journals) >= 2  # several parts were in flight, each journaled
    summary = lifo_job(monkeypatch, LastInFirstOut(max_batch_size=8), tiny_model, data, out, "run.rows_per_part=4",
                       "run.lookahead_parts=3")
    assert summary.state == "done" and summary.reused_samples == 13 - 8 * len(committed)
    lifo_job(monkeypatch, LastInFirstOut(max_batch_size=8), tiny_model, data, tmp_path / "clean",
             "run.rows_per_part=4", "run.lookahead_parts=0")
    assert read_output(out).equals(read_output(tmp_path / "clean"))


def test_auto_lookahead_holds_eight_batches_beyond_the_oldest_part():
    assert auto_lookahead(64, 256, 1) == 2
    assert auto_lookahead(64, 32, 1) == 16
    assert auto_lookahead(64, 32, 4) == 4
    assert auto_lookahead(64, 1024, 1) == 1  # at least one
    assert auto_lookahead(256, 1, 1) == 64  # capped


def test_a_negative_lookahead_is_a_config_error(tiny_model, tmp_path):
    from batchgen.errors import ConfigError

    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match=r"run.lookahead_parts must be >= 0"):
        compose_job(job_overrides(tiny_model, data, tmp_path / "out", "run.lookahead_parts=-1"))


def test_a_job_stopped_by_its_inputs_errors_says_a_rerun_stops_the_same_way_and_names_the_rows(tiny_model, tmp_path):
    """run.max_error_rate exceeded by rows whose input errs (here chat rows with image parts, beside rows of text
    parts that render): the error names the first five rows and their errors and says that rerunning stops the same
    way; the rerun does, naming the same first rows, and the CLI never says "rerun the same command to resume"."""
    text = [{"type": "text", "text": "the river "}, {"type": "text", "text": "rose"}]
    image = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": image if i % 4 else text}]} for i in range(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    args = dummy_overrides(tiny_model, data, tmp_path / "out", "dataset.messages_column=messages",
                           "dataset.id_column=id", "run.rows_per_part=4", "sampling.max_new_tokens=2")
    first = ("The first: row r1: bad_messages: image parts are not supported yet: messages[0].content[1] has type "
             "'image_url'; give the message's text only (text parts or a string), or leave the row out; row r2: ")
    with pytest.raises(ErrorRateExceeded) as raised:
        runner.run_job(compose_job(args))
    said = str(raised.value)
    assert "3 of 4 rows so far recorded errors (bad_messages=3), more than run.max_error_rate=0.5" in said
    assert first in said and said.count("; row r") == 2 and not raised.value.resumable
    assert "rerunning the same command will stop the same way" in said and "run.max_error_rate=1" in said
    proc = run_cli(args, timeout=120)  # the rerun, as the CLI tells it
    assert proc.returncode == 1, proc.stderr
    assert "6 of 8 rows so far recorded errors (bad_messages=6)" in proc.stderr and first in proc.stderr
    assert "rerunning the same command will stop the same way" in proc.stderr and "to resume" not in proc.stderr
    got = read_output(tmp_path / "out").to_pylist()
    assert [(r["id"], r["error"] is None) for r in got] == [(f"r{i}", i % 4 == 0) for i in range(8)]
    assert got[0]["generation"] is not None  # the text-parts row was generated


def test_an_error_rate_with_server_errors_keeps_the_rerun_advice(tmp_path):
    """Errors a server or file system gave at the time (endpoint_failed, unreadable) may not come again: the error
    stays resumable, so the CLI still says how to resume."""
    cfg = JobConfig()  # run.max_error_rate=0.5
    committer = Committer(tmp_path, passthrough=[], metadata={})  # nothing committed yet
    check_error_rate(cfg, PartStats(rows=4, errors={"bad_messages": 1}), committer)  # 1 of 4: under 0.5
    with pytest.raises(ErrorRateExceeded, match="endpoint_failed=2") as raised:
        check_error_rate(cfg, PartStats(rows=4, errors={"endpoint_failed": 2, "bad_messages": 1}), committer)
    assert raised.value.resumable and "stop the same way" not in str(raised.value)
