"""run/stopping.py's Reaper: every process started inside marking() is gone after the job closes it or dies, those
that ignore SIGTERM and those their children start included; nothing unmarked is touched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from batchgen.run.stopping import WATCH_POLL_S, Reaper, marked

# A marked process that ignores SIGTERM and, when SIGTERMed, starts a child that ignores it too (a raylet starting
# an agent while it shuts down): the reap must SIGKILL both.
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
STUBBORN = f"""
import signal, subprocess, sys, time
def late(*_):
    subprocess.Popen([sys.executable, "-c", {DEAF!r}])
signal.signal(signal.SIGTERM, late)
print("up", flush=True)
time.sleep(300)
"""


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the reaper reads /proc")
def test_reaper_leaves_no_marked_process_behind():
    reaper = Reaper().start()
    with reaper.marking():
        stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
        plain = subprocess.Popen(["sleep", "300"])
    bystander = subprocess.Popen(["sleep", "300"])  # started outside marking(): not the reaper's
    try:
        assert stubborn.stdout.readline().strip() == "up"
        assert set(marked(reaper.mark)) >= {stubborn.pid, plain.pid}
        reaper.close()
        assert wait_for(lambda: not marked(reaper.mark), 30), marked(reaper.mark)
        assert stubborn.wait(5) == -9 and plain.wait(5) == -15  # SIGKILL after its ignored SIGTERM; SIGTERM
        assert bystander.poll() is None
    finally:
        for proc in (stubborn, plain, bystander):
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the reaper reads /proc")
def test_reaper_takes_a_descendant_that_lost_the_mark():
    """A marked process's child started with an environment of its own (as Ray's agents can read, once they rename
    themselves) is not marked; its parent dies first (the child becomes init's): the watcher noted it while the
    parent lived and reaps it too. A process started elsewhere is left alone."""
    reaper = Reaper().start()
    spawn_unmarked = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300'], env={}); "
                      "print(p.pid, flush=True); sys.stdin.read()")
    with reaper.marking():
        parent = subprocess.Popen([sys.executable, "-c", spawn_unmarked], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    bystander = subprocess.Popen(["sleep", "300"])
    child = int(parent.stdout.readline())
    try:
        assert child not in marked(reaper.mark) and parent.pid in marked(reaper.mark)
        time.sleep(3 * WATCH_POLL_S)  # the watcher notes the family
        parent.kill()
        parent.wait(5)
        assert os.path.exists(f"/proc/{child}")  # orphaned, still running
        reaper.close()
        assert wait_for(lambda: not os.path.exists(f"/proc/{child}") or _zombie(child), 30)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
