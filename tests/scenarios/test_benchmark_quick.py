"""The throughput benchmark's quick mode as a regression guard: batchgen's job must stay well ahead of
HF generate in fixed batches of 16, as a ratio measured side by side in the same run (not a timed test).

E runs in what engine.dtype=auto picks for the tiny model, float32 on every CPU (its linears are too small to
prepack; measured on the Zen 4 EPYC: E 5990 tok/s in float32, 5354 in bf16). B1 runs in float32 and in bf16 and
the faster counts (--baseline-dtype best): HF at its best dtype on this CPU. Figures, each of one run:
- 2-core AMD EPYC Zen 4 (AVX-512 BF16), 48 rows then, OpenMP threads sleeping at once (PASSIVE): B1 2592 tok/s in
  bf16 (1971 in float32), E/B1 2.24; E/B1 was 3.45 against B1 in float32.
- 2-core AMD EPYC Zen 5 (family 26, AVX-512 BF16), with the short spin every runner has now: at 48 rows E took
  0.5 s and the job's times were printed to 0.1 s, so E/B1 read 1.43 and, in one suite run, 0.88; at 128 rows (the
  quick mode's since) B1 6878.5 tok/s (float32), E 24321.7, E/B1 3.54.
- 2-core AVX2-only EPYC, where bf16 is emulated and B1 runs in float32: the guard passed in every clean-clone CI
  run (the figure was not recorded; not re-measured at 128 rows)."""

from __future__ import annotations

import pytest

from tests.conftest import run_benchmark


@pytest.mark.slow
def test_quick_benchmark_e_over_b1(tmp_path):
    report, printed = run_benchmark("throughput.py", tmp_path, "--quick")
    print(printed)
    med = report["medians"]
    ratio = med["E"]["tok_s"] / med["B1"]["tok_s"]
    assert med["E"]["useful_tokens"] == med["B1"]["useful_tokens"]  # same work: every row ran to its cap
    assert report["dtype"] == "float32" and report["baseline_dtype"] == "best"
    # Without batchgen's kernels (no AVX2 and FMA, or no compiler) E runs torch's own operations: continuous
    # batching must still beat fixed batches (measured 1.11 on the Zen 4 EPYC with its flags narrowed to no AVX2,
    # where B1 still ran the hardware's native bf16), but the kernels' margin is not there to demand.
    floor = 1.5 if "batchgen kernels: none" not in report["cpu"] else 1.0
    assert ratio >= floor, f"E/B1 = {ratio:.2f} (B1 in {med['B1']['dtype']}) on {report['cpu']}, floor {floor}"


def test_the_engine_alone_runner_reads_the_engines_counters(tmp_path):
    """The ENG runner (the engine without the job, for the job's overhead) reads the engine's counters through
    Engine.stats(): every useful token is one row computed (a decode step's or a prefill's), none wasted."""
    report, _ = run_benchmark("throughput.py", tmp_path, "--quick", "--runners", "ENG", "--repeats", "1")
    eng = report["medians"]["ENG"]
    assert "error" not in eng, eng
    assert eng["row_steps"] == eng["useful_tokens"] > 0 and eng["prefill_tokens"] > 0
