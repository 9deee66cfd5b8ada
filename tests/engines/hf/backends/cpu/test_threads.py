"""OpenMP defaults and the thread governor (engines/hf/backends/cpu/threads.py): its policy on scripted clocks, and a
real job beside busy processes on the same cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.engines.hf.backends.cpu import runtime, threads
from batchgen.engines.hf.backends.cpu.threads import MAX_PROBE_S, PROBE_S, SHARE, WINDOW_S, ThreadGovernor

ROOT = Path(__file__).resolve().parents[2]


class Clocks:
    """Wall and CPU clocks that a test advances: each step takes `wall` seconds and `share` of `threads` cores."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def step(self, governor: ThreadGovernor, wall: float, share: float) -> None:
        with governor:
            self.wall += wall
            self.cpu += wall * share * governor.threads


def governed(threads_: int = 2) -> tuple[ThreadGovernor, Clocks, list[int]]:
    clocks, calls = Clocks(), []
    governor = ThreadGovernor(threads_, calls.append, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    return governor, clocks, calls


def run_for(governor: ThreadGovernor, clocks: Clocks, seconds: float, share: float, step: float = 0.01) -> None:
    for _ in range(round(seconds / step)):
        clocks.step(governor, step, share)


def test_idle_cores_keep_every_thread() -> None:
    governor, clocks, calls = governed()
    run_for(governor, clocks, 60, share=0.92)
    assert calls == [] and governor.threads == 2


def test_contention_takes_threads_away_within_a_window_and_a_probe_gives_them_back() -> None:
    governor, clocks, calls = governed()
    run_for(governor, clocks, WINDOW_S + 0.02, share=0.5)
    assert calls == [1] and governor.threads == 1
    run_for(governor, clocks, PROBE_S - 2 * WINDOW_S, share=1.0)  # one thread, its own core: no probe yet
    assert calls == [1]
    run_for(governor, clocks, 3 * WINDOW_S, share=1.0)  # the probe: all threads, and the cores are free
    assert calls == [1, 2] and governor.threads == 2
    run_for(governor, clocks, 30, share=0.95)
    assert calls == [1, 2]


def test_a_probe_that_finds_the_cores_busy_waits_twice_as_long_next_time() -> None:
    governor, clocks, calls = governed()
    run_for(governor, clocks, WINDOW_S + 0.02, share=0.5)
    probes = []
    for _ in range(6):  # each probe finds the cores still busy
        start = clocks.wall
        while calls[-1] == 1:
            clocks.step(governor, 0.01, share=0.5 if governor.threads == 2 else 1.0)
        probes.append(clocks.wall - start)
        run_for(governor, clocks, WINDOW_S + 0.02, share=0.5)  # the probe's window: back to one thread
        assert calls[-1] == 1
    waits = [round(p) for p in probes]
    assert waits == [round(min(PROBE_S * 2 ** i, MAX_PROBE_S)) for i in range(6)]  # 5, 10, 20, 40, 80, 80


def test_many_threads_give_up_the_share_they_lost() -> None:
    governor, clocks, calls = governed(16)
    run_for(governor, clocks, WINDOW_S + 0.02, share=0.7)
    assert calls == [16 - 5]  # 30% of 16 threads, rounded up
    run_for(governor, clocks, WINDOW_S + 0.02, share=SHARE + 0.01)
    assert calls == [11]


def test_openmp_defaults_and_when_threads_spin() -> None:
    env: dict[str, str] = {}
    runtime.set_openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": runtime.SPIN_COUNT} and runtime.openmp_spins(env)
    mine = {"OMP_WAIT_POLICY": "PASSIVE"}
    runtime.set_openmp_defaults(mine)  # the user's own setting wins
    assert mine == {"OMP_WAIT_POLICY": "PASSIVE"} and not runtime.openmp_spins(mine)
    assert runtime.openmp_spins({}) and runtime.openmp_spins({"OMP_WAIT_POLICY": "ACTIVE"})
    assert runtime.openmp_spins({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10k"})
    assert runtime.openmp_spins({"GOMP_SPINCOUNT": "infinite"})
    assert not runtime.openmp_spins({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"})


def test_no_governor_where_it_cannot_tell_or_is_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert threads.for_engine(2, lambda n: None) is None  # sleeping threads: a low share on idle cores too
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert threads.for_engine(1, lambda n: None) is None
    assert isinstance(threads.for_engine(2, lambda n: None), ThreadGovernor)
    monkeypatch.setenv("BATCHGEN_ADAPT_THREADS", "0")
    assert threads.for_engine(2, lambda n: None) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs and sched_setaffinity")
def test_a_job_beside_busy_processes_on_its_cores_gives_up_a_thread(tmp_path: Path) -> None:
    """A real job pinned to two CPUs, a busy process pinned to each: the governor drops to one thread, logs it, and
    the job still writes every row. The model is the 'small' toy model (hidden 256, oneDNN GEMMs that use both
    threads), under the CLI's OpenMP defaults."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.engines.toymodel import build_model

    cpus = sorted(os.sched_getaffinity(0))[:2]
    model = tmp_path / "small"
    build_model(model, [f"row {i} " + "word " * (i % 17) for i in range(200)], size="small")
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i} " + "word " * (i % 17) for i in range(48)]}), data)
    busy = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
            for c in cpus]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "BATCHGEN_ADAPT_THREADS")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "batchgen", "name=t", f"output_dir={tmp_path / 'out'}", f"dataset.path={data}",
             f"engine.model={model}", "engine.dtype=float32", "engine.threads=2", "sampling.max_new_tokens=64",
             "sampling.ignore_eos=true", "run.progress=false"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    log = "".join(p.read_text() for p in (tmp_path / "out").glob("_logs/*/batchgen.log"))  # engine internals
    assert "other work holds the cores" in log and "2 -> 1 threads" in log, log[-3000:]
    assert pq.read_table(tmp_path / "out").num_rows == 48


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not runtime.has_native_bf16(), reason="bf16 is checked where it is native (where engine.dtype=auto picks it); "
                                          "an emulating CPU's torch bf16 model was not measured for this"))])
def test_outputs_do_not_depend_on_the_thread_count(tmp_path: Path, dtype: str) -> None:
    """What the governor changes must not change a row: prefill and decode logits, 2 threads against 1, bit for bit
    (the 'small' toy model: oneDNN GEMMs and batchgen's kernels, each output element computed by one thread).
    Measured to hold on the Zen 5 EPYC, in float32 and bf16, and there with the flags narrowed to avx2 and noavx2."""
    import torch
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.engines.toymodel import build_model

    model = tmp_path / "small"
    build_model(model, [f"row {i} " + "word " * (i % 17) for i in range(200)], size="small")
    engine = HFEngine(HFConfig(model=str(model), dtype=dtype, device="cpu"), AutoTokenizer.from_pretrained(model))
    stepper = engine.stepper
    before = torch.get_num_threads()
    outs = {}
    try:
        with torch.inference_mode():
            for n_threads in (2, 1):
                torch.set_num_threads(n_threads)
                cache = stepper.new_cache(40, 256)
                logits = [stepper.prefill(cache, 0, [[5 + (i * 7 + j) % 200 for j in range(10 + 3 * i)]
                                                     for i in range(40)])]
                logits += [stepper.decode(cache, torch.arange(n) % 200 + 3) for n in (40, 17, 1)]
                outs[n_threads] = logits
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(outs[2], outs[1]))
