"""The GPU tier (`pytest -m gpu`, run by scripts/gpu_check.sh on a lent CUDA machine; every test skips without CUDA):
the hf engine on CUDA against HF generate, the scheduler with rows joining and leaving, quantized jobs, a real CUDA
out-of-memory caught and halved, and a SIGKILL and resume on CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_parquet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FIGURES = Path(os.environ.get("BATCHGEN_GPU_FIGURES", "")) if os.environ.get("BATCHGEN_GPU_FIGURES") else None


def record(name: str, value) -> None:
    """Figures for gpu_check.sh's JSON (BATCHGEN_GPU_FIGURES names the file), printed either way."""
    print(f"{name}: {value}")
    if FIGURES is not None:
        figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
        FIGURES.write_text(json.dumps(figures | {name: value}, indent=2))


def hf_greedy(model_path: str, texts: list[str], caps: list[int], dtype: torch.dtype) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to("cuda").eval()
    out = []
    for text, cap in zip(texts, caps):
        ids = tok(text, return_tensors="pt")["input_ids"].to("cuda")
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cap, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        out.append(tok.decode(seq[0, ids.shape[1]:], skip_special_tokens=True))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_on_cuda_equals_one_row_hf_generate(tiny_model, tmp_path, dtype):
    """Rows of different caps join and leave the batch (the scheduler); float32 must equal HF token for token,
    bf16 agreement is reported (its rounding differs with the batch's shape)."""
    texts = corpus(48, seed=41)
    caps = [4 + (i * 7) % 29 for i in range(48)]
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t, "cap": c} for t, c in zip(texts, caps)])
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine.device=cuda", f"engine.dtype={dtype}",
                                                "dataset.max_new_tokens_column=cap", "sampling.max_new_tokens=64",
                                                "engine.max_batch_size=16", "run.rows_per_part=12")))
    assert summary.state == "done"
    ours = [r["generation"] for r in read_output(out).to_pylist()]
    ref = hf_greedy(tiny_model, texts, caps, getattr(torch, dtype))
    same = sum(a == b for a, b in zip(ours, ref))
    record(f"cuda greedy {dtype}: rows equal to one-row HF generate", f"{same}/48")
    if dtype == "float32":
        assert ours == ref


@pytest.mark.parametrize("scheme", ["int8", "int4", "bnb-int8", "bnb-nf4"])
def test_quantized_jobs_write_every_row_on_cuda(tiny_model, tmp_path, scheme):
    package = "bitsandbytes" if scheme.startswith("bnb") else "torchao"
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{scheme} needs {package} (scripts/gpu_wheels.sh carries it where it fits)")
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in corpus(24, seed=43)])
    out = tmp_path / "out"
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine.device=cuda",
                                                f"engine.quantization={scheme}", "engine.dtype=bfloat16",
                                                "sampling.max_new_tokens=16", "run.rows_per_part=8")))
    rows = read_output(out).to_pylist()
    assert summary.state == "done" and len(rows) == 24 and all(r["error"] is None for r in rows)
    record(f"cuda {scheme}: rows written", len(rows))


def test_a_real_cuda_oom_is_caught_and_halved(tiny_model, tmp_path):
    """Fill the GPU nearly full first, then ask for a prefill budget far past what is left: the engine halves and
    goes on, and every row is written."""
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(max(free - (1 << 30), 0), dtype=torch.uint8, device="cuda")  # leave about 1 GiB
    try:
        texts = [" ".join(corpus(40, seed=i)) for i in range(64)]  # long prompts
        data = write_parquet(tmp_path / "in.parquet", [{"prompt": t} for t in texts])
        out = tmp_path / "out"
        summary = run_job(compose_job(job_overrides(tiny_model, data, out, "engine.device=cuda",
                                                    "engine.max_batch_tokens=4000000", "engine.max_batch_size=64",
                                                    "sampling.max_new_tokens=8", "run.rows_per_part=64")))
    finally:
        del hog
        torch.cuda.empty_cache()
    status = json.loads((out / "_status.json").read_text())
    backoffs = (status.get("engine") or {}).get("oom_backoffs", 0)
    record("cuda oom backoffs", backoffs)
    assert summary.state == "done" and read_output(out).num_rows == 64 and backoffs >= 1


def test_sigkill_and_resume_on_cuda(tiny_model, tmp_path, capsys):
    from tests.scenarios.test_crash import load_harness

    report = load_harness().run_harness(3, work=tmp_path, model=tiny_model, rows=24, seed=13,
                                        extra=("engine.device=cuda",))
    with capsys.disabled():
        print("\ncuda " + report.render())
    record("cuda kill harness", report.render())
    assert report.kills >= 3 and report.rows_checked >= 24
