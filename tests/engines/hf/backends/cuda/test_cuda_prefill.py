"""Prefill without padding (backends/cuda/prefill.py and the CUDA stepper's packed prefill), checked on CPU tensors.

The Triton kernel runs under the interpreter, which triton.jit chooses when the module is imported, so everything
that runs it runs in one subprocess started with TRITON_INTERPRET=1 (this file as a script; one JSON line of
results). The kernel against its torch reference: float32 and bfloat16 caches, GQA groups 1 and 2, rows of one
token, rows across block boundaries, rows after a cached prefix, NaN in every position and slot no row may read.
The reference against torch's SDPA (here, in process). The CUDA stepper's packed prefill against the reference
stepper's padded one: several prompts of very different lengths in one call, rows after a cached prefix, a prompt
prefilled in chunks, and the final hidden states task=loglik/embed read (float32, 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from batchgen.engines.hf.backends.cuda import prefill

KERNEL_CASES = {  # name -> kv_heads, heads, d, dtype, rows as (count, start, slot)
    "f32_mha": (4, 4, 16, "float32", [(40, 0, 2), (1, 0, 0), (7, 0, 4)]),
    "f32_gqa_after_prefix": (2, 4, 32, "float32", [(33, 31, 1), (1, 90, 3), (64, 0, 0), (65, 5, 2)]),
    "bf16_gqa": (1, 2, 16, "bfloat16", [(50, 0, 0), (17, 40, 1)]),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
PROMPT_LENGTHS = (45, 3, 17, 1, 29)


def kernel_case(kv_heads: int, heads: int, d: int, dtype: str, rows: list) -> float:
    torch.manual_seed(0)
    slots, max_len = 6, 128
    k, v = (torch.randn(slots, kv_heads, max_len, d).to(getattr(torch, dtype)) for _ in range(2))
    for count, start, slot in rows:  # nothing a row may not read is a number
        k[slot, :, start + count:] = v[slot, :, start + count:] = float("nan")
    used = {slot for _, _, slot in rows}
    for slot in set(range(slots)) - used:
        k[slot] = v[slot] = float("nan")
    counts, starts, slot_ids = (list(t) for t in zip(*rows))
    q = torch.randn(sum(counts), heads, d).to(k.dtype)
    got = prefill.prefill_attention(q, k, v, counts, starts, slot_ids, d ** -0.5)
    want = prefill.prefill_attention_reference(q, k, v, counts, starts, slot_ids, d ** -0.5)
    assert got.dtype == q.dtype and got.shape == q.shape and bool(got.isfinite().all())
    return (got.float() - want.float()).abs().max().item()


def stepper_cases(model_dir: str) -> dict:
    """The CUDA stepper's packed prefill (the kernel under the interpreter) against the reference stepper."""
    from transformers import AutoModelForCausalLM

    from batchgen.engines.hf.backends.cuda.step import CudaStepper
    from batchgen.engines.hf.step import LlamaStepper

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    packed, reference = CudaStepper(model), LlamaStepper(model)
    assert packed.packed_prefill and "varlen" in packed.describe()
    out = {}
    with torch.inference_mode():
        def run(stepper, hidden=False):
            cache = stepper.new_cache(8, 64)
            fn = stepper.prefill_hidden if hidden else stepper.prefill
            whole = fn(cache, 0, prompts)
            # rows 5 and 6: the first prompt after a 20-token prefix in its slot, then in chunks of 16
            stepper.prefill(cache, 5, [prompts[0][:20]])
            after = stepper.prefill(cache, 5, [prompts[0]], [20])
            chunks = [stepper.prefill(cache, 6, [prompts[0][:end]], [end - 16 if end > 16 else 0])
                      for end in (16, 32)] + [stepper.prefill(cache, 6, [prompts[0]], [32])]
            return whole, after, chunks[-1], cache

        for hidden in (False, True):
            got, want = run(packed, hidden), run(reference, hidden)
            name = "hidden" if hidden else "logits"
            out[name] = (got[0] - want[0]).abs().max().item()
            out[name + "_after_prefix"] = (got[1] - want[1]).abs().max().item()
            out[name + "_chunked"] = (got[2] - want[2]).abs().max().item()
            out[name + "_chunked_vs_whole"] = (got[2] - want[0][:1]).abs().max().item() if not hidden else 0.0
            out[name + "_cache"] = max((got[3].k[:, :7] - want[3].k[:, :7]).abs().max().item(),
                                       (got[3].v[:, :7] - want[3].v[:, :7]).abs().max().item())
            assert got[3].host_lengths[:7] == [*PROMPT_LENGTHS, 45, 45]
    return out


def interpreter_env() -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def results(tiny_model) -> dict:
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, __file__, tiny_model], env=interpreter_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_the_varlen_kernel_equals_its_reference(results, name):
    assert results["interpreted"]
    assert results[name] <= TOLERANCE[KERNEL_CASES[name][3]], results[name]


@pytest.mark.parametrize("what", ["logits", "hidden"])
def test_the_packed_prefill_equals_the_reference_steppers(results, what):
    """Several prompts in one call, a row after a cached prefix, a prompt in chunks: logits (or hidden states)
    and the cache's keys and values within 1e-4 of the padded reference."""
    for case in ("", "_after_prefix", "_chunked", "_cache"):
        assert results[what + case] < 1e-4, (what + case, results[what + case])


def test_a_prompt_prefilled_in_chunks_ends_where_one_prefill_ends(results):
    assert results["logits_chunked_vs_whole"] < 1e-4


@pytest.mark.parametrize("start", [0, 9])
def test_the_reference_is_causal_attention_over_the_slot(start):
    """prefill_attention_reference against torch's SDPA over each row's slot positions [0, start + count)."""
    torch.manual_seed(1)
    k, v = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    counts, starts, slots = [12, 5], [start, start], [2, 0]
    q = torch.randn(sum(counts), 4, 8)
    got = prefill.prefill_attention_reference(q, k, v, counts, starts, slots, 0.3)
    first = 0
    for count, slot in zip(counts, slots):
        end = start + count
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        want = F.scaled_dot_product_attention(q[first:first + count].transpose(0, 1)[None], k[slot:slot + 1, :, :end],
                                              v[slot:slot + 1, :, :end], attn_mask=mask, scale=0.3, enable_gqa=True)
        assert torch.allclose(got[first:first + count], want[0].transpose(0, 1), atol=1e-5)
        first += count


def test_cpu_tensors_outside_the_interpreter_get_the_reference():
    k = v = torch.randn(2, 1, 16, 8)
    q = torch.randn(5, 2, 8)
    got = prefill.prefill_attention(q, k, v, [5], [3], [1], 0.5)
    assert torch.equal(got, prefill.prefill_attention_reference(q, k, v, [5], [3], [1], 0.5))


def test_shape_errors_name_what_does_not_fit():
    k = v = torch.randn(2, 1, 16, 8)
    with pytest.raises(ValueError, match="packed tokens"):
        prefill.prefill_attention(torch.randn(5, 2, 8), k, v, [4], [0], [0], 1.0)
    with pytest.raises(ValueError, match="past the cache"):
        prefill.prefill_attention(torch.randn(5, 2, 8), k, v, [5], [12], [0], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_kernel_equals_the_reference_on_cuda(dtype):
    """The kernel compiled for the GPU: GQA (8 query heads on 2 KV heads), d 64 and 128, rows of 1 to 700 new
    tokens after prefixes of 0 to 300 in a 1024-position cache, equal to the reference (float32 within 1e-4,
    16-bit within 2e-2, tensor-core products)."""
    torch.manual_seed(0)
    for d in (64, 128):
        k, v = (torch.randn(6, 2, 1024, d, device="cuda", dtype=dtype) for _ in range(2))
        counts, starts, slots = [700, 1, 64, 65, 300], [0, 300, 17, 0, 9], [3, 0, 5, 1, 2]
        q = torch.randn(sum(counts), 8, d, device="cuda", dtype=dtype)
        got = prefill.prefill_attention(q, k, v, counts, starts, slots, d ** -0.5).float()
        want = prefill.prefill_attention_reference(q, k, v, counts, starts, slots, d ** -0.5).float()
        assert torch.allclose(got, want, atol=1e-4 if dtype == torch.float32 else 2e-2), (d, dtype)


if __name__ == "__main__":
    from batchgen.engines.hf.backends.cuda.attention import interpreted

    report = {name: kernel_case(*case) for name, case in KERNEL_CASES.items()}
    report.update(stepper_cases(sys.argv[1]), interpreted=interpreted())
    print(json.dumps(report))
