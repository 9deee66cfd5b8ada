"""The output lock: one writer per shard of an output_dir, a refusal that names the holder, a probe that never
takes the lock, one sharding layout per output_dir among live writers, and a dead writer's lock taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.errors import BatchgenError, LockedError
from batchgen.output.lock import LAYOUT, OutputLock, is_held, live_writers, lock_name, read_holder, writer_locks

REPO = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pathlib import Path
from batchgen.output.lock import OutputLock
lock = OutputLock.for_shard(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_lock_is_refused_while_the_first_is_held_and_taken_after_release(tmp_path):
    first, second = OutputLock(tmp_path), OutputLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(LockedError) as refused:
            second.acquire()
        assert issubclass(LockedError, BatchgenError) and LockedError.exit_code == 2
        message = str(refused.value)
        assert f"pid {os.getpid()} on {socket.gethostname()}" in message
        assert str(tmp_path) in message and "wait for it to finish or stop it" in message
        assert first.is_held() and second.is_held()
        assert second.holder()["pid"] == os.getpid()  # the refusal left the holder's note alone
    finally:
        first.release()
    assert not second.is_held()
    second.acquire()
    try:
        with pytest.raises(LockedError):
            first.acquire()
    finally:
        second.release()


def test_the_holder_note_names_the_holder_and_goes_with_the_release(tmp_path):
    lock = OutputLock.for_shard(tmp_path, 3, 4)
    assert lock.holder() is None
    with lock:
        note = lock.holder()
        assert note == read_holder(tmp_path / "_lock.shard-00003.holder.json")
        assert note["pid"] == os.getpid() and note["host"] == socket.gethostname()
        assert note["shard"] == 3 and note["num_shards"] == 4 and note["since"]
    assert lock.holder() is None and not lock.holder_path.exists() and not lock.is_held()


def test_read_holder_is_none_for_a_missing_or_torn_note(tmp_path):
    assert read_holder(tmp_path / "missing.holder.json") is None
    torn = tmp_path / "_lock.holder.json"
    torn.write_text('{"pid": 12')
    assert read_holder(torn) is None
    torn.write_text(json.dumps({"pid": 12}))
    assert read_holder(torn) == {"pid": 12}


def test_is_held_probes_without_taking_the_lock_and_never_creates_the_file(tmp_path):
    path = tmp_path / "_lock"
    assert not is_held(path) and not path.exists()
    lock = OutputLock(tmp_path)
    with lock:
        for _ in range(3):
            assert is_held(path)
        assert lock.is_held()
        with pytest.raises(LockedError):  # probing did not break the holder's lock
            OutputLock(tmp_path).acquire()
    for _ in range(3):
        assert not is_held(path)
    other = OutputLock(tmp_path)  # probing an idle lock left it idle
    other.acquire()
    try:
        assert is_held(path)
    finally:
        other.release()


def test_lock_names_per_shard_and_shards_of_one_layout_run_side_by_side(tmp_path):
    assert lock_name(0, 1) == "_lock"
    assert lock_name(0, 2) == "_lock.shard-00000" and lock_name(3, 8) == "_lock.shard-00003"
    assert lock_name(12345, 20000) == "_lock.shard-12345"
    a, b = OutputLock.for_shard(tmp_path, 0, 2), OutputLock.for_shard(tmp_path, 1, 2)
    assert a.path.name == "_lock.shard-00000" and b.path.name == "_lock.shard-00001"
    assert OutputLock.for_shard(tmp_path, 0, 1).path == tmp_path / "_lock"
    with a, b:
        writers = live_writers(tmp_path)
        assert [(w["lock"], w["shard"], w["num_shards"], w["pid"]) for w in writers] == [
            ("_lock.shard-00000", 0, 2, os.getpid()), ("_lock.shard-00001", 1, 2, os.getpid())]
        assert [p.name for p in writer_locks(tmp_path)] == ["_lock.shard-00000", "_lock.shard-00001"]
        assert (tmp_path / LAYOUT).exists() and not is_held(tmp_path / LAYOUT)  # released after each start
        with pytest.raises(LockedError):
            OutputLock.for_shard(tmp_path, 1, 2).acquire()
    assert live_writers(tmp_path) == []


@pytest.mark.parametrize(("held", "mine"), [((0, 2), (0, 1)), ((0, 2), (2, 3)), ((0, 1), (1, 2))])
def test_a_live_writer_of_another_layout_is_refused(tmp_path, held, mine):
    with OutputLock.for_shard(tmp_path, *held):
        refused = OutputLock.for_shard(tmp_path, *mine)
        with pytest.raises(LockedError) as exc:
            refused.acquire()
        message = str(exc.value)
        assert f"run.num_shards={held[1]} (pid {os.getpid()}" in message
        assert f"this run has run.num_shards={mine[1]}" in message
        assert not refused.is_held() and not refused.holder_path.exists()  # refused before taking its own lock
    with OutputLock.for_shard(tmp_path, *mine):  # once that writer is gone, the other layout may start
        assert [w["num_shards"] for w in live_writers(tmp_path)] == [mine[1]]


def test_a_note_without_its_sharding_on_the_unsharded_lock_counts_as_one_shard(tmp_path):
    with OutputLock(tmp_path) as lock:
        lock.holder_path.write_text(json.dumps({"pid": 1, "host": "old"}))  # an older batchgen's note
        assert live_writers(tmp_path) == [{"pid": 1, "host": "old", "num_shards": 1, "lock": "_lock"}]
        with pytest.raises(LockedError, match="run.num_shards=1"):
            OutputLock.for_shard(tmp_path, 0, 2).acquire()


def hold_in_child(output_dir: Path, shard: int, num_shards: int) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(output_dir), str(shard), str(num_shards)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    if line.strip() != "held":
        child.kill()
        pytest.fail(f"the child did not take the lock: {line!r} {child.stderr.read()}")
    return child


def test_a_killed_writers_lock_is_taken_over(tmp_path):
    child = hold_in_child(tmp_path, 0, 1)
    try:
        lock = OutputLock(tmp_path)
        assert lock.is_held() and lock.holder()["pid"] == child.pid
        with pytest.raises(LockedError, match=f"pid {child.pid} on"):
            lock.acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert not lock.is_held() and lock.holder()["pid"] == child.pid  # its note stays, naming a dead process
    assert live_writers(tmp_path) == []
    with lock:
        assert lock.holder()["pid"] == os.getpid()


def test_a_killed_writer_of_another_layout_no_longer_blocks(tmp_path):
    child = hold_in_child(tmp_path, 1, 2)
    try:
        assert [(w["pid"], w["num_shards"]) for w in live_writers(tmp_path)] == [(child.pid, 2)]
        with pytest.raises(LockedError, match=f"run.num_shards=2 \\(pid {child.pid} on"):
            OutputLock(tmp_path).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert read_holder(tmp_path / "_lock.shard-00001.holder.json")["num_shards"] == 2
    with OutputLock(tmp_path) as lock:
        assert [w["lock"] for w in live_writers(tmp_path)] == ["_lock"] and lock.is_held()
