"""run/stopping.py's Reaper: every process started inside marking() is gone after the job closes it or dies, those
that ignore SIGTERM and those their children start included; nothing unmarked is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from batchgen.run.stopping import Reaper, marked

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
