"""engine.quantization for the hf engine: real jobs end to end, weight bytes, config errors, fidelity."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.checks import validate
from batchgen.engines.hf import quant
from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import onednn as cpu_linear
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.quant import int4, int8, w4a8, w8a8
from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, run_benchmark, run_cli, write_parquet

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="needs torchao: pip install 'batchgen[quant]'")
# int4 on CPU runs batchgen's own kernel where it is built, torchao's elsewhere
needs_int4 = pytest.mark.skipif(cpu_kernels.load() is None and not HAS_TORCHAO,
                                reason="int4 on this CPU needs torchao: pip install 'batchgen[quant]'")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def quantized_job(model: str, tmp_path, scheme: str, *extra: str):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": text} for text in corpus(12, seed=3)])
    overrides = [o for o in job_overrides(model, data, tmp_path / "out") if not o.startswith("engine.dtype=")]
    dtype = [] if any(e.startswith("engine.dtype=") for e in extra) else ["engine.dtype=auto"]
    return compose_job([*overrides, f"engine.quantization={scheme}", *dtype, "engine.device=cpu",
                        "sampling.max_new_tokens=6", "run.rows_per_part=5", *extra])


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
@pytest.mark.parametrize("scheme", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantized_job_writes_every_row(small_model, tmp_path, scheme, dtype):
    """auto (whatever this CPU measured faster), bf16 (its dequantized GEMMs in bf16, float32 around them where
    batchgen's kernels run) and float32."""
    summary = run_job(quantized_job(small_model, tmp_path, scheme, f"engine.dtype={dtype}"))
    table = read_output(tmp_path / "out")
    assert summary.state == "done" and table.num_rows == 12
    assert table.column("error").null_count == 12
    assert all(n > 0 for n in table.column("num_generated_tokens").to_pylist())
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert scheme in json.dumps(manifest)  # the scheme is part of the model identity


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> str:
    """The 76M-param benchmark model (benchmarks/quantization.py); about 10 s to build."""
    from batchgen.engines.toymodel import build_model

    return str(build_model(tmp_path_factory.mktemp("models") / "bench-llama", corpus(), size="bench"))


def int4_kind() -> type:
    """What engine.quantization=int4 builds here: W4A8 linears where batchgen's VNNI kernel runs, else weight-only."""
    return w4a8.Int4DynamicLinear if w4a8.runs_here(cpu_kernels.load()) else int4.Int4WeightOnlyLinear


def test_int8_weights_take_at_most_055x_of_bf16(bench_model):
    model = load(bench_model, torch.float32)
    params = sum(p.numel() for p in model.parameters())
    assert quant.weight_bytes(int8.int8_cpu(model, torch.device("cpu"))) <= 0.55 * 2 * params
    model = load(bench_model, torch.float32)
    assert quant.weight_bytes(int8.int8_wo_cpu(model, torch.device("cpu"))) <= 0.55 * 2 * params


def test_int4_weights_take_at_most_035x_of_bf16(bench_model):
    """batchgen's int4: every block linear in int4 (group 64), the LM head and the embeddings in int8."""
    native_or_skip()
    model = load(bench_model, torch.float32)
    params = sum(p.numel() for p in model.parameters())
    quantized = int4.int4_cpu(model, torch.device("cpu"))
    assert sum(isinstance(m, int4.Int4WeightOnlyLinear) for m in quantized.modules()) == 12 * 7
    assert isinstance(quantized.lm_head, int8.Int8WeightOnlyLinear)
    assert quant.weight_bytes(quantized) <= 0.35 * 2 * params


@needs_torchao
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: int4 linears as bf16 islands
def test_torchao_int4_weights_take_at_most_035x_of_bf16(bench_model, dtype):
    """torchao's int4, which runs where batchgen's CPU kernels are not built."""
    model = load(bench_model, dtype)
    params = sum(p.numel() for p in model.parameters())
    quantized = int4.int4_cpu_torchao(model, torch.device("cpu"))
    assert quant.weight_bytes(quantized) <= 0.35 * 2 * params
    if dtype == torch.float32:
        assert sum(isinstance(m, cpu_linear.CastLinear) for m in quantized.modules()) == 12 * 7
        with torch.inference_mode():
            logits = quantized(input_ids=torch.tensor([[5, 6, 7]])).logits
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("extra, expected", [
    (["engine.quantization=bnb-nf4", "engine.device=cpu"], "bnb-nf4 does not run with engine.device=cpu"),
    (["engine.quantization=bnb-int8", "engine.device=cpu"], "supported devices: cuda"),
    (["engine.quantization=int4", "engine.device=cpu", "engine.dtype=float16"], "choices: auto, bfloat16, float32"),
    (["engine.quantization=int8", "engine.device=cpu", "engine.dtype=float16"], "choices: auto, float32, bfloat16"),
    (["engine.quantization=int3"], "choices: int8, int8_wo, int4, bnb-int8, bnb-nf4"),
])
def test_invalid_combinations_are_config_errors(tiny_model, tmp_path, extra, expected):
    overrides = [o for o in job_overrides(tiny_model, tmp_path / "in.parquet", tmp_path / "out")
                 if not o.startswith("engine.dtype=") or not any(e.startswith("engine.dtype=") for e in extra)]
    with pytest.raises(ConfigError) as err:
        validate(compose_job([*overrides, *extra]))
    assert expected in str(err.value)


def test_bnb_on_cpu_exits_2_before_the_model_loads(tiny_model, tmp_path):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "the river"}])
    proc = run_cli(job_overrides(tiny_model, data, tmp_path / "out", "engine.quantization=bnb-nf4",
                                 "engine.device=cpu"), timeout=120)
    assert proc.returncode == 2 and "engine.quantization=bnb-nf4" in proc.stderr and "cuda" in proc.stderr


def native_or_skip():
    if cpu_kernels.load() is None:
        pytest.skip("batchgen's CPU kernels are not built here (they need x86-64 with AVX2 and FMA, and a C compiler)")


def force_kernel(module: nn.Module, kernel: str, rows: int) -> None:
    """Send inputs of up to `rows` rows through one path of the model's int8 (or int4) weight-only linears."""
    if kernel == "native":
        native_or_skip()
        assert quant.route_rows(module, native_rows=rows + 1, dequant_rows=rows + 1)
    elif kernel == "aten":
        assert quant.route_rows(module, native_rows=0, dequant_rows=rows + 1)
    else:  # dequantized weights, float GEMM
        assert quant.route_rows(module, native_rows=0, dequant_rows=0)


@pytest.mark.parametrize("path", ["dequant", "aten", "native"])
def test_int8_top1_agreement_with_the_unquantized_benchmark_model(bench_model, path):
    """Teacher forcing on 8 x 128 seeded token ids through the 76M-param benchmark model: int8 weight-only must keep
    the unquantized model's next token at >= 90% of the positions. The 1024 positions go through one forward,
    with every linear forced through one path: `dequant` as the engine runs prefills (dequantized weights,
    float32 GEMM), `aten` (aten._weight_int8pack_mm, bfloat16 activations) and `native` (batchgen's AVX2 kernel,
    float32 activations) as it runs small decode batches."""
    model = load(bench_model, torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.argmax(-1)  # [8, 128]
        int8.int8_wo_cpu(model, torch.device("cpu"))
        force_kernel(model, path, 8 * 128)
        got = model(input_ids=ids).logits.argmax(-1)
    assert sum(isinstance(m, int8.Int8WeightOnlyLinear) for m in model.modules()) == 12 * 7 + 1  # + the LM head
    agreement = (ref == got).float().mean().item()
    assert agreement >= 0.9, f"int8 top-1 agreement {agreement:.1%} ({path})"


@pytest.mark.parametrize("kernel,rows", [("aten", 1), ("aten", 5), ("native", 1), ("native", 5), ("native", 40),
                                         ("dequant", 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_weight_only_linear_matches_nn_linear(kernel, rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=bias)
    x = torch.randn(2, rows, 256)  # any leading shape
    with torch.inference_mode():
        ref = linear(x)
        q = int8.Int8WeightOnlyLinear(linear)
        force_kernel(q, kernel, 2 * rows)
        got = q(x)
        exact = F.linear(x, q.qweight.float() * q.scale.float()[:, None], linear.bias)  # the int8 weights in fp32
    assert got.shape == ref.shape == (2, rows, 96) and got.dtype == torch.float32
    assert q.qweight.dtype == torch.int8 and q.scale.shape == (96,)
    # int8 weights, one scale per output channel: about 1% relative error on random weights; bfloat16
    # activations and output in aten's kernel add about 0.3%; the native kernel and the dequantized GEMM
    # compute the int8 weights' product in float32; where batchgen's kernel does not run, the dequantized GEMM rounds
    # its input and output to bf16 as aten's kernel does (a row reads the same whatever its batch's size)
    assert (got - ref).norm() / ref.norm() < 0.02
    if kernel == "aten" or kernel == "dequant" and q.native is None:
        assert torch.allclose(got, exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
    else:
        assert torch.allclose(got, exact, rtol=1e-4, atol=1e-5)


def test_int8_leaves_linears_the_kernel_cannot_take(monkeypatch):
    """aten's kernel takes input sizes that are multiples of 16; batchgen's own kernel takes any."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 12), nn.Linear(12, 8))  # 12: not a multiple

    x = torch.randn(3, 64)
    with torch.inference_mode():
        want = model()(x)
    if cpu_kernels.load() is not None:
        native = model()
        assert int8.int8_weight_only_linears(native) == (3, 0)
        with torch.inference_mode():
            assert (native(x) - want).norm() / want.norm() < 0.03
    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    aten = model()
    assert int8.int8_weight_only_linears(aten) == (2, 1)
    assert [type(m).__name__ for m in aten] == ["Int8WeightOnlyLinear", "ReLU", "Int8WeightOnlyLinear", "Linear"]
    with torch.inference_mode():
        assert aten(x).shape == (3, 8)


@pytest.mark.parametrize("isa", cpu_kernels.supported_isas() or ["none"])
def test_native_int8_kernel_matches_a_float_reference(isa):
    """Odd sizes (remainders of the 8-wide loop and of the 4-channel blocks), bias or not, several rows; under every
    kernel variant this CPU runs."""
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        native_or_skip()
    torch.manual_seed(0)
    for m, k, n, biased in [(1, 768, 768, False), (3, 100, 13, True), (7, 2048, 770, True), (1, 12, 5, False)]:
        x, w = torch.randn(m, k), torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scale, bias = torch.rand(n) / 100, torch.randn(n) if biased else None
        got = cpu_ops.int8_gemm(lib, x, w, scale, bias)
        want = x @ w.float().t() * scale + (0 if bias is None else bias)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (m, k, n)


def test_a_scheme_slow_at_the_working_batch_says_so_on_a_cpu_of_the_kind_it_was_measured_on(monkeypatch, caplog):
    monkeypatch.setattr(quant, "cpu_kind", lambda: "avx2")
    monkeypatch.setitem(quant.CPU_WORKING_BATCH_VS_UNQUANTIZED, "avx2", {"int8_wo": 0.5})
    with caplog.at_level("WARNING", logger=quant.__name__):
        quant.warn_if_slow_at_working_batch("int8_wo")
    assert "int8_wo on this CPU decodes large batches slower than the unquantized model: 0.50x" in caplog.text
    assert "(avx2;" in caplog.text and "does not fit in memory unquantized" in caplog.text
    caplog.clear()
    monkeypatch.setattr(quant, "cpu_kind", lambda: "never-measured")
    with caplog.at_level("WARNING", logger=quant.__name__):
        quant.warn_if_slow_at_working_batch("int8_wo")
    assert not caplog.text  # no figure for this kind: nothing claimed


def test_the_figure_is_that_of_what_the_scheme_built_here(monkeypatch, caplog):
    """int8 that fell back to weight-only warns with int8_wo's figure; int4 built as W4A8 (batchgen's VNNI kernel)
    has its own, and the int8 kernels' figures on their CPU kind warn nothing (measured faster)."""
    monkeypatch.setattr(quant, "cpu_kind", lambda: "avx512_bf16")
    weight_only = nn.Sequential(int8.Int8WeightOnlyLinear(nn.Linear(64, 16)))
    assert quant.measured_as("int8", weight_only) == "int8_wo"
    with caplog.at_level("WARNING", logger=quant.__name__):
        quant.warn_if_slow_at_working_batch("int8", weight_only)
    assert "int8_wo on this CPU decodes large batches slower" in caplog.text
    caplog.clear()
    if w4a8.runs_here(cpu_kernels.load()):
        w4 = nn.Sequential(w4a8.Int4DynamicLinear(nn.Linear(64, 16)), w8a8.Int8DynamicLinear(nn.Linear(64, 16)))
        assert quant.measured_as("int4", w4) == "int4-w4a8" and quant.measured_as("int8", w4) == "int8"
        with caplog.at_level("WARNING", logger=quant.__name__):
            quant.warn_if_slow_at_working_batch("int4", w4)
            quant.warn_if_slow_at_working_batch("int8", w4)
        assert not caplog.text


@pytest.mark.slow
def test_quick_benchmark_prints_the_table(tmp_path):
    report, printed = run_benchmark("quantization.py", tmp_path, "--quick")
    rows = {r["config"]: r for r in report["rows"]}
    # against bf16 (2 bytes a parameter), whatever dtype `none` runs in here: 0.545x on the tiny model (its norms and
    # int8 embedding scales weigh more than a large model's)
    assert set(rows) == {"none", "int8"} and rows["int8"]["vs_bf16"] < 0.6 and "| int8 |" in printed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("scheme", ["int8", "int4", "bnb-int8", "bnb-nf4"])
def test_cuda_schemes_generate(small_model, scheme):
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    package = "bitsandbytes" if scheme.startswith("bnb") else "torchao"
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{scheme} needs {package}")
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    engine = HFEngine(HFConfig(model=small_model, device="cuda", quantization=scheme), tokenizer)
    params = SampleParams(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
    results = engine.generate([Request(key=0, prompt_ids=[1, 20, 30], params=params, seed=None)])
    assert results[0].num_generated_tokens == 4 and engine.identity()["quantization"] == scheme


def load(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.skipif(w8a8.probe() is not None, reason=f"W8A8 does not run here: {w8a8.probe()}")
def test_w8a8_top1_agreement_with_the_unquantized_benchmark_model(bench_model):
    """int8 (W8A8: per-token int8 activations) keeps the unquantized model's next token at >= 90% of 8 x 128
    teacher-forced positions, as weight-only does; every linear W8A8, the LM head included."""
    model = load(bench_model, torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (8, 128), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.argmax(-1)
        int8.int8_cpu(model, torch.device("cpu"))
        got = model(input_ids=ids).logits.argmax(-1)
    assert sum(isinstance(m, w8a8.Int8DynamicLinear) for m in model.modules()) == 12 * 7 + 1
    agreement = (ref == got).float().mean().item()
    assert agreement >= 0.9, f"W8A8 top-1 agreement {agreement:.1%}"


@pytest.mark.parametrize("scheme", ["int8", "int8_wo", "int4"])
def test_quantized_projections_fuse_and_generate_what_unfused_ones_do(small_model, monkeypatch, scheme):
    """q/k/v and gate/up of an int8 (int4) model become one weight-only linear each (scales are per output channel,
    int4 groups run along the input, so nothing is requantized); greedy generations equal the unfused model's."""
    from transformers import AutoTokenizer

    from batchgen.engines.hf import engine as hf
    from batchgen.engines.hf.backends.cpu import backend as cpu_backend
    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.fusion import FusedSlice
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    if scheme == "int4":
        native_or_skip()  # int8 runs aten's kernel where batchgen's is not built
    if scheme == "int8" and w8a8.probe() is not None:
        pytest.skip(f"W8A8 does not run here: {w8a8.probe()}")
    kind = {"int8": w8a8.Int8DynamicLinear, "int8_wo": int8.Int8WeightOnlyLinear, "int4": int4_kind()}[scheme]
    # the same OpenMP threads for both engines: the thread governor, taking threads away while other work (another
    # test worker) holds the cores, would change the unfused path's torch reductions between the two engines' runs
    monkeypatch.setenv("BATCHGEN_ADAPT_THREADS", "0")
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    # float32: in bf16 a fused GEMM may block its sums differently from the parts and round apart
    config = HFConfig(model=small_model, quantization=scheme, device="cpu", dtype="float32", max_batch_size=8)
    fused = hf.HFEngine(config, tokenizer)
    layers = fused.model.config.num_hidden_layers
    attn = fused.model.model.layers[0].self_attn
    assert fused.fused == 2 * layers and isinstance(attn.qkv_proj, kind)
    assert isinstance(attn.k_proj, FusedSlice)
    monkeypatch.setattr(cpu_backend, "fuse_projections", lambda model, fuse: 0)
    plain = hf.HFEngine(config, tokenizer)
    params = SampleParams(max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
    reqs = [Request(key=i, prompt_ids=tokenizer(text).input_ids, params=params, seed=None)
            for i, text in enumerate(corpus(6, seed=4))]
    assert not plain.stepper.native_step  # batchgen's decode step needs fused projections: torch's step runs
    want = [r.text for r in plain.generate(reqs)]
    native = fused.stepper.native_step
    # the same torch step over the fused modules: the fused product is the parts' bits, so the same tokens. (The
    # native step's kernels sum in another order and may quantize an activation one step apart: its logits are
    # tested against this step's in test_w8a8 and test_engine_hf, within tolerance; greedy tokens of a random model
    # are not, a near tie flips, as seen for int4 on AVX-512 CPUs.)
    fused.stepper.native_step, fused.stepper.gemm_inputs, fused.stepper.row_exact = False, [], False
    assert [r.text for r in fused.generate(reqs)] == want
    fused.stepper.native_step = native
    fused.fast = False  # the model's own forward, through the FusedSlices
    assert [r.text for r in fused.generate(reqs)] == want


# -- int4 -------------------------------------------------------------------------------------------

def test_int4_packing_round_trips_and_quantization_stays_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(40, 256) * torch.rand(40, 1)  # channels of different ranges
    weight[0] = 0.99 + torch.rand(256) / 100  # narrow groups far from zero: the min's rounding matters there
    weight[1] = -0.99 - torch.rand(256) / 100
    q, scale, mins = int4.quantize_int4(weight, 64)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == mins.shape == (40, 4)
    packed = int4.pack_int4(q)
    assert packed.shape == (40, 128) and torch.equal(int4.unpack_int4(packed), q)
    assert torch.equal(packed[2, :4], torch.tensor([q[2, 0] | q[2, 8] << 4, q[2, 16] | q[2, 24] << 4,
                                                    q[2, 32] | q[2, 40] << 4, q[2, 48] | q[2, 56] << 4],
                                                   dtype=torch.uint8))  # lane 0 of block 0: planes 0..7
    rebuilt = (q.float().view(40, 4, 64) * scale.float()[..., None] + mins.float()[..., None]).view(40, 256)
    step = scale.float().repeat_interleave(64, dim=1)
    assert ((rebuilt - weight).abs() <= 0.5 * step * (1 + 1e-3) + 1e-7).all()


@pytest.mark.parametrize("rows,path", [(1, "native"), (2, "native"), (5, "native"), (40, "native"), (7, "dequant")])
@pytest.mark.parametrize("bias", [True, False])
def test_int4_weight_only_linear_matches_its_dequantized_weights(rows, path, bias):
    native_or_skip()
    torch.manual_seed(0)
    linear = nn.Linear(256, 100, bias=bias)  # 100 outputs: a remainder after the kernel's 4-channel blocks
    x = torch.randn(2, rows, 256)
    with torch.inference_mode():
        ref = linear(x)
        q = int4.Int4WeightOnlyLinear(linear)
        quant.route_rows(q, native_rows=2 * rows + 1 if path == "native" else 0)
        got = q(x)
        weights = int4.unpack_int4(q.qweight).float().view(100, 4, 64) * q.scale.float()[..., None]
        exact = F.linear(x, (weights + q.mins.float()[..., None]).view(100, 256), linear.bias)
    assert got.shape == ref.shape == (2, rows, 100) and got.dtype == torch.float32
    assert torch.allclose(got, exact, rtol=1e-4, atol=1e-5)
    assert torch.allclose(q.dequantize(), (weights + q.mins.float()[..., None]).view(100, 256))
    # 16 levels over each group's range: on nn.Linear's uniform weights, about 7% relative error
    assert (got - ref).norm() / ref.norm() < 0.1


@pytest.mark.parametrize("isa", cpu_kernels.supported_isas() or ["none"])
def test_native_int4_kernel_matches_a_float_reference(isa):
    """Group 64 and 128, odd channel counts, rows in pairs and alone, bias or not; under every kernel variant."""
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        native_or_skip()
    torch.manual_seed(0)
    for m, k, n, group, biased in [(1, 768, 768, 64, False), (3, 128, 13, 64, True), (6, 2048, 770, 128, True),
                                   (1, 64, 5, 64, False), (1, 768, 100, 64, True), (1, 256, 13, 128, True)]:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = (torch.rand(n, k // group) / 50).to(torch.bfloat16)
        mins = (-torch.rand(n, k // group) / 5).to(torch.bfloat16)
        x, bias = torch.randn(m, k), torch.randn(n) if biased else None
        weights = (q.float().view(n, -1, group) * scale.float()[..., None] + mins.float()[..., None]).view(n, k)
        want = x @ weights.t() + (0 if bias is None else bias)
        got = cpu_ops.int4_gemm(lib, x, int4.pack_int4(q), scale, mins, group, bias)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (m, k, n, group)
        assert torch.equal(cpu_ops.int4_dequantize(lib, int4.pack_int4(q), scale, mins, group), weights)


def test_int4_decode_path_agrees_with_its_prefill_path_on_the_benchmark_model(bench_model):
    """The same int4 weights through batchgen's kernel (decode) and dequantized (prefill): the same next tokens."""
    native_or_skip()
    model = int4.int4_cpu(load(bench_model, torch.float32), torch.device("cpu"))
    ids = torch.randint(10, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        quant.route_rows(model, native_rows=0)
        prefill = model(input_ids=ids).logits
        quant.route_rows(model, native_rows=2 * 64 + 1)
        decode = model(input_ids=ids).logits
    assert (prefill.argmax(-1) == decode.argmax(-1)).float().mean() > 0.99
    assert torch.allclose(prefill, decode, atol=1e-3 * prefill.abs().max().item())


def test_int4_on_cpu_needs_torchao_only_without_batchgens_kernels(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(quant.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: object())
    assert quant.check("int4", "cpu", "auto") == []
    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    assert any("needs torchao" in problem for problem in quant.check("int4", "cpu", "auto"))


@pytest.mark.parametrize("scheme", ["int8_wo", "int4"])
def test_quantized_bf16_runs_its_prefill_gemms_in_bf16_and_float32_around_them(small_model, scheme):
    """engine.dtype=bfloat16 with int8/int4 on CPU: the quantized linears (fused ones included) dequantize to bf16 for
    their many-row GEMMs; the model and batchgen's kernels stay float32; logits track the float32 engine's."""
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine

    native_or_skip()
    if scheme == "int4" and int4_kind() is w4a8.Int4DynamicLinear:
        pytest.skip("int4 runs W4A8 here (batchgen's VNNI kernel: int8 GEMMs, no dequantized ones)")
    tokenizer = AutoTokenizer.from_pretrained(small_model)
    engines = {dtype: HFEngine(HFConfig(model=small_model, quantization=scheme, device="cpu", dtype=dtype),
                               tokenizer) for dtype in ("bfloat16", "float32")}
    bf16 = engines["bfloat16"]
    kind = {"int8_wo": int8.Int8WeightOnlyLinear, "int4": int4.Int4WeightOnlyLinear}[scheme]
    quantized = [m for m in bf16.model.modules() if isinstance(m, kind)]
    assert bf16.fused and quantized and all(m.gemm_dtype == torch.bfloat16 for m in quantized)
    assert bf16.identity()["activations"] == "float32" and bf16.model.model.norm.weight.dtype == torch.float32
    ids = torch.randint(10, bf16.model.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():  # 400 rows: the dequantized GEMM path
        got, want = (engines[d].model(input_ids=ids).logits for d in ("bfloat16", "float32"))
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_a_quantized_model_holds_no_view_of_its_checkpoint(small_model):
    """Norm weights and biases left as loaded would keep the whole safetensors file mapped (every page read while
    quantizing counts in the resident size); tied parameters stay tied."""
    model = quant.load_model(small_model, scheme_name="int8", device=torch.device("cpu"), dtype=torch.float32,
                             trust_remote_code=False)
    mapped = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith(".safetensors")]
    spans = [tuple(int(v, 16) for v in span.split("-")) for span in mapped]
    inside = [name for name, p in model.named_parameters()
              if any(lo <= p.untyped_storage().data_ptr() < hi for lo, hi in spans)]
    assert not inside
    shared = nn.Linear(8, 8)
    tied = nn.Sequential(shared, shared)
    assert quant.own_parameters(tied) == 2 and tied[0].weight is tied[1].weight


def test_a_converted_weights_checkpoint_pages_are_given_back_and_read_the_same_after(tmp_path, monkeypatch):
    """A weight from_pretrained left as a view of the mapped checkpoint: its whole pages are given back once its
    replacement exists (a later read faults the file's bytes in again: the values are unchanged); memory of the heap
    is never given back. Through a real conversion, a tied weight is not released."""
    from safetensors.torch import load_file, save_file

    from batchgen.engines.hf.backends.cpu.runtime import CheckpointPages

    save_file({"w": torch.randn(512, 512)}, str(tmp_path / "w.safetensors"))
    mapped = load_file(str(tmp_path / "w.safetensors"))["w"]  # a view of the file's mapping
    want = mapped.clone()
    mappings = CheckpointPages()
    if not mappings.spans or mappings.madvise is None:
        pytest.skip("no file mapping or no madvise here")
    assert mappings.release(want) == 0  # heap memory: never
    assert mappings.release(mapped) >= 512 * 512 * 4 - 2 * 4096  # the whole pages of its 1 MiB
    assert torch.equal(mapped, want)
    released = []
    monkeypatch.setattr(CheckpointPages, "release", lambda self, tensor: released.append(tensor) or 0)
    tied, twin, alone = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    twin.weight = tied.weight
    weight = alone.weight
    cpu_linear.replace_linears(nn.Sequential(tied, twin, alone), w8a8.Int8DynamicLinear)
    assert len(released) == 1 and released[0] is weight


def test_quantizing_in_blocks_of_rows_changes_no_bit(monkeypatch):
    """quantize_by_rows bounds the float temporaries of a large LM head or embedding table; every row's int8 values
    and scale are what quantizing the whole matrix at once gives (int8_wo's bf16-rounded scales, W8A8's float32
    ones, the embedding's per-row ones)."""
    from batchgen.engines.hf.quant import common

    torch.manual_seed(4)
    weight = torch.randn(30, 48) * torch.rand(30, 1)
    linear = nn.Linear(48, 30, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    whole = (int8.Int8WeightOnlyLinear(linear), w8a8.quantize_weight(weight), int8.Int8Embedding(weight))
    monkeypatch.setattr(common, "QUANTIZE_ROWS", 7)
    monkeypatch.setattr(common.quantize_by_rows, "__defaults__", (7,))
    blocked = (int8.Int8WeightOnlyLinear(linear), w8a8.quantize_weight(weight), int8.Int8Embedding(weight))
    assert torch.equal(whole[0].qweight, blocked[0].qweight) and torch.equal(whole[0].scale, blocked[0].scale)
    assert all(torch.equal(a, b) for a, b in zip(whole[1], blocked[1]))
    assert torch.equal(whole[2].qweight, blocked[2].qweight) and torch.equal(whole[2].scale, blocked[2].scale)
    scale = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).to(torch.bfloat16)  # the formula, whole matrix
    want = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(blocked[0].qweight, want)


# -- placement: model.to(device) moves every tensor a quantized module holds ------------------------

def loose_tensors(model: nn.Module) -> list[str]:
    """Tensors a module holds outside its parameters and buffers (plain attributes, or inside a list, tuple or dict
    attribute): model.to(device) leaves them where they are, and the first forward on the device mixes devices."""
    loose = []
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            value = list(value.values()) if isinstance(value, dict) else value
            values = value if isinstance(value, (list, tuple)) else [value]
            loose += [f"{name or 'model'}.{key}" for v in values if isinstance(v, torch.Tensor)]
    return loose


def held(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


@pytest.mark.parametrize("scheme", ["int8", "int8_wo", "int4"])
def test_quantized_modules_hold_every_tensor_where_model_to_moves_it(small_model, scheme):
    """Each scheme this CPU builds (int8: W8A8 or weight-only; int4: W4A8 or weight-only) keeps its tensors as
    parameters or buffers: after model.to("meta") none is left on the CPU. Once packed for the GEMMs (pack_all, as
    the engine does after fusing), W8A8's oneDNN-packed weights are mkldnn tensors, which no device but the CPU
    takes: there model.to(torch.float64) shows every floating tensor is reached instead."""
    if scheme == "int4":
        native_or_skip()  # torchao's int4 otherwise: its tensor subclasses are torchao's to place
    convert = quant.CONVERTERS[(scheme, "cpu")]
    model = convert(load(small_model, torch.float32), torch.device("cpu"))
    assert not loose_tensors(model)
    assert not [name for name, t in held(model.to("meta")) if t.device.type != "meta"]
    packed = convert(load(small_model, torch.float32), torch.device("cpu"))
    quant.pack_w8a8(packed)
    assert not loose_tensors(packed)
    floats = [(name, t) for name, t in held(packed) if t.is_floating_point()]
    packed.to(torch.float64)
    assert floats and not [name for name, t in held(packed) if t.is_floating_point() and t.dtype != torch.float64]


def test_int8_embedding_rows_lie_on_the_tables_device():
    """int8 on CUDA quantizes the embedding table after the model is placed: its rows and scales stay on the table's
    device (meta here), not on the CPU, where the first lookup with ids on the GPU failed."""
    table = torch.empty(300, 64, device="meta")
    embed = int8.Int8Embedding(table)
    assert embed.qweight.device.type == "meta" and embed.scale.device.type == "meta"
    linear = nn.Linear(64, 32, device="meta")
    assert all(t.device.type == "meta" for t in w8a8.quantize_weight(linear.weight))
