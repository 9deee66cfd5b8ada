"""The part journal: results survive a reopen, a torn tail is cut off, a foreign journal is not trusted;
and in a job, an interrupted part resumes from its journal without generating its journaled samples again (on
engine=dummy; the hf engine killed mid-part and resumed: tests/scenarios/test_crash.py's kill harness)."""

from __future__ import annotations

import pytest

from batchgen.engines.dummy import DummyEngine
from batchgen.output.journal import Journal, journal_key, read_journal
from batchgen.records import Result
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, dummy_overrides, read_output, write_parquet

KEY = journal_key(part=3, first_row=30, ids=["a", "b", "c"], config_hash="abc", n=1)


def result(key: int) -> Result:
    return Result(key=key, text=f"text {key} \u00e9\u6f22", finish_reason="length", num_prompt_tokens=5,
                  num_generated_tokens=4)


def test_results_survive_a_reopen_and_appends_continue(tmp_path):
    path = tmp_path / "_part-00003.journal"
    journal, found = Journal.open(path, KEY, valid_keys={0, 1, 2})
    assert found == []
    with journal:
        journal.append(result(2))
        journal.append(result(0))
    journal, found = Journal.open(path, KEY, valid_keys={0, 1, 2})
    assert found == [result(2), result(0)]
    with journal:
        journal.append(result(1))
    assert read_journal(path) == (KEY, [result(2), result(0), result(1)], 0)
    journal.remove()
    assert not path.exists()


def journal_bytes(path, keys: list[int]) -> bytes:
    journal, _ = Journal.open(path, KEY, valid_keys={0, 1, 2})
    with journal:
        for k in keys:
            journal.append(result(k))
    return path.read_bytes()


@pytest.mark.parametrize("cut", [1, 5, 8, 20])
def test_a_torn_tail_is_dropped_and_the_journal_stays_appendable(tmp_path, cut):
    """A crash inside the second frame: only its first `cut` bytes reached the disk."""
    head = journal_bytes(tmp_path / "one.journal", [0])
    path = tmp_path / "_part-00003.journal"
    full = journal_bytes(path, [0, 1])
    path.write_bytes(full[:len(head) + cut])
    assert read_journal(path) == (KEY, [result(0)], cut)
    journal, found = Journal.open(path, KEY, valid_keys={0, 1, 2})
    assert found == [result(0)] and path.read_bytes() == head
    with journal:
        journal.append(result(1))
    assert path.read_bytes() == full


def test_garbage_after_the_last_frame_fails_the_crc(tmp_path):
    path = tmp_path / "_part-00003.journal"
    good = journal_bytes(path, [0])
    path.write_bytes(good + good[-40:])  # bytes of a frame's tail: a length field that does not check out
    assert read_journal(path) == (KEY, [result(0)], 40)


def test_a_journal_of_another_part_or_config_is_not_trusted(tmp_path):
    path = tmp_path / "_part-00003.journal"
    journal, _ = Journal.open(path, KEY, valid_keys={0, 1, 2})
    with journal:
        journal.append(result(1))
    other = journal_key(part=3, first_row=30, ids=["a", "b", "x"], config_hash="abc", n=1)
    journal, found = Journal.open(path, other, valid_keys={0, 1, 2})
    journal.close()
    assert found == [] and read_journal(path) == (other, [], 0)
    journal, _ = Journal.open(path, KEY, valid_keys={0, 1, 2})
    with journal:
        journal.append(result(2))
    journal, found = Journal.open(path, KEY, valid_keys={0, 1})  # a request the part no longer plans
    journal.close()
    assert found == []


class Interrupted(Exception):
    pass


def test_an_interrupted_part_resumes_from_its_journal(tiny_model, tmp_path, monkeypatch):
    """The engine dies after 7 results of part 1; the rerun reuses those 7 and generates only the rest,
    and the result equals an uninterrupted run's. One part at a time (look-ahead 0), so that the first 10
    results are part 0's; tests/run/test_feed.py stops with several parts in flight."""
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(20, seed=2)])
    extra = ("run.rows_per_part=10", "run.lookahead_parts=0", "sampling.max_new_tokens=6", "sampling.ignore_eos=true")
    run_job(compose_job(dummy_overrides(tiny_model, data, tmp_path / "clean", *extra)))
    real_stream = DummyEngine.stream
    seen = {"results": 0}

    def dying_stream(self, source, on_result):
        def counted(result):
            on_result(result)
            seen["results"] += 1
            if seen["results"] == 10 + 7:  # part 0 whole, then 7 results of part 1
                raise Interrupted

        return real_stream(self, source, counted)

    out = tmp_path / "out"
    cfg = compose_job(dummy_overrides(tiny_model, data, out, *extra))
    monkeypatch.setattr(DummyEngine, "stream", dying_stream)
    with pytest.raises(Interrupted):
        run_job(cfg)
    monkeypatch.setattr(DummyEngine, "stream", real_stream)
    assert [p.name for p in out.glob("part-*")] == ["part-00000.parquet"]
    key, journaled, torn = read_journal(out / "_part-00001.journal")
    assert len(journaled) == 7 and torn == 0 and key["part"] == 1
    summary = run_job(cfg)
    assert summary.state == "done" and summary.reused_samples == 7
    assert summary.generated_tokens == 3 * 6  # only the 3 samples the journal did not hold were generated
    assert not list(out.glob("_part-*.journal"))
    assert read_output(out).equals(read_output(tmp_path / "clean"))
