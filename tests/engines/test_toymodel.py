"""engines/toymodel.py, as `make demo` uses it (scripts/build_demo_model.py): building the stand-in model prints one
line, no blank lines from the tokenizer's trainer and no "Writing model shards" bar."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_building_the_demo_model_says_one_line(tmp_path):
    out = tmp_path / "demo-llama"
    built = subprocess.run([sys.executable, "scripts/build_demo_model.py", "--out", str(out), "--size", "tiny"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout == f"built a random-weight tiny Llama stand-in at {out}\n", built.stdout
    assert "Writing model shards" not in built.stderr, built.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
