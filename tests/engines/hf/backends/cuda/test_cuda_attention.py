"""The Triton split-K decode attention (backends/cuda/attention.py) against its plain torch reference.

The kernels run on CPU under Triton's interpreter, which triton.jit chooses when the module is imported, so the
comparisons run in one subprocess started with TRITON_INTERPRET=1: it runs this file as a script over CASES and
prints one JSON line of results that the tests read. Cases: GQA groups 2 and 4, head dims 16/32/48/64, lengths 1,
on a block boundary, at max_len, one long row among short ones, fewer rows than slots, one to eight splits, the
`out=` buffer (a strided view) and a strided q, float32 against bfloat16 and float16 caches, NaN past every row's
length and in the unused slots, and no host read of the lengths. The fallback without Triton and on CPU tensors
outside the interpreter runs in this process and in a subprocess that cannot import triton. The compiled kernels
(CUDA, graph capture, tensor-core bfloat16 products) are not run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from batchgen.engines.hf.backends.cuda import attention

F32, BF16, F16 = "float32", "bfloat16", "float16"
# name -> shapes, the rows' lengths, dtypes (cache, query), splits (None: num_splits_for) and what else it checks
CASES: dict[str, dict] = {
    "f32_group2": dict(n=3, slots=3, kv_heads=2, d=32, max_len=200, lengths=[1, 64, 200]),
    "f32_group4_long_among_short": dict(n=5, slots=5, kv_heads=1, d=64, max_len=300, lengths=[300, 1, 128, 17, 63],
                                        splits=4),
    "f32_one_split": dict(n=2, slots=4, kv_heads=2, d=16, max_len=130, lengths=[130, 64], splits=1),
    "f32_eight_splits": dict(n=2, slots=3, kv_heads=1, d=32, max_len=300, lengths=[5, 300], splits=8),
    "f32_d48_padded": dict(n=2, slots=2, kv_heads=2, d=48, max_len=100, lengths=[100, 33], splits=2),
    "f32_length0_int32_long_lengths": dict(n=2, slots=4, kv_heads=2, d=16, max_len=64, lengths=[0, 9, 10**6, 7],
                                           length_dtype="int32", splits=2),
    "bf16_group2": dict(n=3, slots=4, kv_heads=2, d=32, max_len=200, lengths=[1, 128, 200], dtype=BF16,
                        q_dtype=BF16),
    "bf16_cache_f32_query_group4": dict(n=4, slots=5, kv_heads=1, d=64, max_len=256, lengths=[256, 3, 64, 100],
                                        dtype=BF16, splits=3),
    "f16_group2": dict(n=3, slots=3, kv_heads=2, d=32, max_len=150, lengths=[150, 64, 2], dtype=F16, q_dtype=F16),
    "f32_nan_tail": dict(n=3, slots=5, kv_heads=2, d=32, max_len=200, lengths=[1, 64, 150], nan=True, splits=3),
    "bf16_nan_tail_group4": dict(n=3, slots=4, kv_heads=1, d=32, max_len=200, lengths=[200, 7, 65], dtype=BF16,
                                 q_dtype=BF16, nan=True, splits=4),
    "f32_out_buffer_q_view": dict(n=3, slots=4, kv_heads=2, d=32, max_len=130, lengths=[129, 2, 64], out=True,
                                  q_view=True),
    "bf16_out_buffer": dict(n=2, slots=2, kv_heads=1, d=16, max_len=70, lengths=[70, 1], dtype=BF16, q_dtype=BF16,
                            out=True),
    "f32_no_host_reads": dict(n=2, slots=2, kv_heads=2, d=16, max_len=100, lengths=[100, 40], guard=True),
}
HEADS = 4
TOLERANCE = {F32: 1e-5, BF16: 2e-2, F16: 2e-2}
HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__index__", "__float__", "nonzero", "cpu"}


class HostReads(TorchFunctionMode):
    """Records the torch calls that would read `watched` (or a view of it) on the host: a sync on CUDA, an error
    under graph capture."""

    def __init__(self, watched: torch.Tensor):
        super().__init__()
        self.storage, self.seen = watched.untyped_storage().data_ptr(), []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS and any(isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr()
                                      == self.storage for arg in args):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def inputs(spec: dict, seed: int = 0) -> tuple:
    """q, k_cache, v_cache, lengths of a case; with `nan`, every cache position past a row's length and every
    unused slot holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, spec.get("dtype", F32))
    shape = (spec["slots"], spec["kv_heads"], spec["max_len"], spec["d"])
    k, v = (torch.randn(shape, generator=gen) for _ in range(2))
    q = torch.randn(spec["n"], HEADS, spec["d"], generator=gen).to(getattr(torch, spec.get("q_dtype", F32)))
    if spec.get("q_view"):  # q as a fused projection's slice: rows 3 * heads * d apart
        q = torch.cat([q, q, q], dim=1)[:, HEADS:2 * HEADS]
    lengths = torch.tensor(spec["lengths"], dtype=getattr(torch, spec.get("length_dtype", "int64")))
    if spec.get("nan"):
        for cache in (k, v):
            cache[spec["n"]:] = float("nan")
            for row, length in enumerate(spec["lengths"]):
                cache[row, :, length:] = float("nan")
    return q, k.to(dtype), v.to(dtype), lengths


def run_case(spec: dict) -> dict:
    """The kernel's output against the float32 reference: largest absolute error, finiteness, whether `out` came
    back filled, and the host reads of the lengths seen."""
    q, k, v, lengths = inputs(spec)
    scale = spec["d"] ** -0.5
    out = torch.full((spec["n"], HEADS, 2 * spec["d"]), 7.0, dtype=q.dtype)[..., :spec["d"]] if spec.get("out") \
        else None
    guard = HostReads(lengths)
    with guard:
        got = attention.decode_attention(q, k, v, lengths, scale, out=out, num_splits=spec.get("splits"))
    want = attention.decode_attention_reference(q.float(), k, v, lengths, scale)
    return {"err": (got.float() - want).abs().max().item(), "finite": bool(got.isfinite().all()),
            "dtype": str(got.dtype).removeprefix("torch."), "shape": list(got.shape),
            "same_out": out is not None and got is out, "host_reads": guard.seen,
            "interpreted": attention.interpreted()}


def interpreter_env() -> dict:
    """This process's environment with Triton's interpreter on."""
    return {**os.environ, "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case, run once under the interpreter in a subprocess."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, __file__], env=interpreter_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(results, name):
    spec, got = CASES[name], results[name]
    assert got["interpreted"], "the kernels did not run under the interpreter"
    assert got["finite"]
    assert got["shape"] == [spec["n"], HEADS, spec["d"]]
    assert got["dtype"] == spec.get("q_dtype", F32)
    assert got["err"] <= TOLERANCE[spec.get("dtype", F32)], got["err"]


def test_out_buffer_is_filled_and_returned(results):
    assert results["f32_out_buffer_q_view"]["same_out"] and results["bf16_out_buffer"]["same_out"]


def test_lengths_never_read_on_the_host(results):
    assert all(not got["host_reads"] for got in results.values()), {k: r["host_reads"] for k, r in results.items()}


def test_host_reads_guard_sees_the_reference_read_lengths():
    """The guard of test_lengths_never_read_on_the_host catches a read through a view (the reference syncs)."""
    q, k, v, lengths = inputs(CASES["f32_group2"])
    with HostReads(lengths) as guard:
        attention.decode_attention_reference(q, k, v, lengths, 0.25)
    assert guard.seen == ["tolist"]


def test_reference_reads_each_row_over_its_own_length():
    """One row by hand: softmax over positions [0, length) only, query heads 0-1 on KV head 0, 2-3 on 1."""
    q, k, v, lengths = inputs(CASES["f32_nan_tail"])
    got = attention.decode_attention_reference(q, k, v, lengths, 0.5)
    row, length = 2, CASES["f32_nan_tail"]["lengths"][2]
    for head in range(HEADS):
        kv = head // 2
        weights = ((k[row, kv, :length] @ q[row, head]) * 0.5).softmax(0)
        torch.testing.assert_close(got[row, head], weights @ v[row, kv, :length])


def test_cpu_tensors_without_the_interpreter_get_the_reference():
    """In this process (no TRITON_INTERPRET) CPU tensors take the reference, `out=` included."""
    spec = CASES["bf16_group2"]
    q, k, v, lengths = inputs(spec)
    out = torch.empty(spec["n"], HEADS, spec["d"], dtype=q.dtype)
    got = attention.decode_attention(q, k, v, lengths, 0.25, out=out)
    assert got is out
    torch.testing.assert_close(got, attention.decode_attention_reference(q, k, v, lengths, 0.25))


def test_imports_and_falls_back_without_triton():
    """Where triton is not installed the module imports, available() is False and the reference answers."""
    script = ("import sys; sys.modules['triton'] = None\n"
              "import torch\nfrom batchgen.engines.hf.backends.cuda import attention as a\n"
              "assert not a.available() and not a.interpreted()\n"
              "q, k = torch.randn(2, 4, 16), torch.randn(3, 2, 20, 16); n = torch.tensor([20, 3])\n"
              "torch.testing.assert_close(a.decode_attention(q, k, k, n, 0.25), "
              "a.decode_attention_reference(q, k, k, n, 0.25))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=interpreter_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_shape_errors():
    q, k = torch.randn(2, 3, 16), torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError):
        attention.decode_attention(q[:, :2], k, k, torch.tensor([1, 1]), 0.25, out=torch.empty(2, 2, 8))
    with pytest.raises(ValueError):
        attention.decode_attention(q, k, k, torch.tensor([1, 1]), 0.25)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        attention.decode_attention(torch.randn(3, 2, 16), k, k, torch.tensor([1, 1, 1]), 0.25)  # 3 rows, 2 slots


def test_num_splits_from_shapes():
    cpu = torch.device("cpu")
    assert attention.num_splits_for(1, 1, 64, cpu) == 1  # one block: one split
    assert attention.num_splits_for(1, 1, 100_000, cpu) <= attention.MAX_SPLITS
    assert attention.num_splits_for(64, 8, 4096, cpu) == 1  # enough (row, KV head) pairs already


def main() -> None:
    """The subprocess: every case under the interpreter, one JSON line out."""
    assert attention.interpreted(), "run with TRITON_INTERPRET=1"
    print(json.dumps({name: run_case(spec) for name, spec in CASES.items()}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_kernel_equals_the_reference_on_cuda_and_replays_in_a_graph(dtype):
    """The kernel compiled for the GPU: GQA (8 query heads on 2 KV heads), d 64, rows of 1 to 700 positions in a
    1024-position cache, equal to the reference (float32 within 1e-4, 16-bit within 2e-2); captured in a CUDA graph
    and replayed after the lengths changed, the same as a fresh call."""
    torch.manual_seed(0)
    q = torch.randn(6, 8, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(8, 2, 1024, 64, device="cuda", dtype=dtype) for _ in range(2))
    lengths = torch.tensor([1, 700, 64, 65, 300, 2], device="cuda")
    want = attention.decode_attention_reference(q, k, v, lengths, 0.125).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(attention.decode_attention(q, k, v, lengths, 0.125).float(), want, atol=tolerance)
    out = torch.empty_like(q)
    attention.decode_attention(q, k, v, lengths, 0.125, out=out)  # warm-up (compiles) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.decode_attention(q, k, v, lengths, 0.125, out=out)
    lengths.copy_(torch.tensor([5, 9, 1000, 1, 77, 512], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    fresh = attention.decode_attention_reference(q, k, v, lengths, 0.125).float()
    assert torch.allclose(out.float(), fresh, atol=tolerance)


if __name__ == "__main__":
    main()
