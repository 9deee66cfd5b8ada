"""The throughput benchmark's quick mode as a regression guard: batchgen's job must stay well ahead of
HF generate in fixed batches of 16, as a ratio measured side by side in the same run (not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_quick_benchmark_e_over_b1(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, "benchmarks/throughput.py", "--quick", "--workdir", str(tmp_path),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    med = json.loads(out.read_text())["medians"]
    ratio = med["E"]["tok_s"] / med["B1"]["tok_s"]
    assert med["E"]["useful_tokens"] == med["B1"]["useful_tokens"]  # same work: every row ran to its cap
    assert ratio >= 1.5, f"E/B1 = {ratio:.2f}"
