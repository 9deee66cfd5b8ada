"""W8A8 int8 linears (quant/w8a8.py): per-token activation quantization (batchgen's kernel on every variant this CPU
runs, and torch's fallback), oneDNN's int8 GEMM checked against exact integer arithmetic, the fallback to weight-only
where the GEMM saturates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.quant import w8a8
from tests.conftest import REPO

ISAS = cpu_kernels.supported_isas()
needs_w8a8 = pytest.mark.skipif(w8a8.probe() is not None, reason=f"W8A8 does not run here: {w8a8.probe()}")


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented arithmetic: scale = max|x| / 127, q = round_half_even(x * (127 / max)) + 128."""
    peak = x.abs().amax(dim=1)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    return (torch.round(x * inv[:, None]) + 128).to(torch.uint8), peak / 127.0


def rows_to_quantize() -> list[torch.Tensor]:
    torch.manual_seed(0)
    hot = torch.randn(5, 896)
    hot[1] *= 50  # one large token
    ties = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 3.5, 4.5, 5.5]]) / 127 * 127  # halves: to even
    return [torch.randn(1, 896), hot, torch.randn(3, 13), torch.randn(64, 4864) * 3, torch.zeros(2, 40), ties,
            torch.randn(0, 16)]


@pytest.mark.parametrize("isa", ISAS or ["none"])
def test_the_quantize_kernel_is_the_documented_arithmetic_on_every_variant(isa):
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        pytest.skip("batchgen's CPU kernels are not built here (x86-64 with AVX2 and FMA, a C compiler)")
    for x in rows_to_quantize():
        q, scale = cpu_ops.quantize_rows(lib, x.contiguous())
        want_q, want_scale = reference_quantize(x)
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale), tuple(x.shape)


def test_the_torch_fallback_quantizes_as_the_kernel_does(monkeypatch):
    """Where the kernels are not built, torch operations give the same bytes and scales."""
    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    for x in rows_to_quantize():
        q, scale = w8a8.quantize_rows(x.contiguous())
        want_q, want_scale = reference_quantize(x)
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale), tuple(x.shape)


@pytest.mark.parametrize("native", [True, False])
def test_a_row_with_a_nan_or_an_infinity_gets_a_nan_scale(monkeypatch, native):
    if not native:
        monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    elif cpu_kernels.load() is None:
        pytest.skip("batchgen's CPU kernels are not built here")
    x = torch.randn(4, 37)
    x[1, 3], x[2, 36] = float("nan"), float("-inf")  # in the vector body and in the scalar tail
    q, scale = w8a8.quantize_rows(x)
    assert scale.isnan().tolist() == [False, True, True, False]
    assert torch.equal(q[1], torch.full((37,), 128, dtype=torch.uint8))


@pytest.mark.parametrize("bias", [True, False])
def test_scale_rows_multiplies_each_row_and_adds_the_bias(monkeypatch, bias):
    y, scale = torch.randn(5, 37), torch.rand(5)
    b = torch.randn(37) if bias else None
    want = y * scale[:, None] + (0 if b is None else b)
    if cpu_kernels.load() is not None:
        assert torch.allclose(w8a8.scale_rows(y.clone(), scale, b), want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(cpu_kernels, "load", lambda isa=None: None)
    assert torch.allclose(w8a8.scale_rows(y.clone(), scale, b), want, rtol=1e-6, atol=1e-6)


@needs_w8a8
@pytest.mark.parametrize("bias", [True, False])
def test_the_linear_is_exact_integer_arithmetic_then_the_scales(bias):
    """Against int64 products of the same int8 values: oneDNN's int32 sums are exact; the scales are applied in
    float32 (two roundings)."""
    torch.manual_seed(1)
    linear = nn.Linear(896, 200, bias=bias)
    x = torch.randn(2, 7, 896)
    x[0, 0] *= 20  # a hot token
    module = w8a8.Int8DynamicLinear(linear)
    qweight, wscale = module.qweight.clone(), module.scale.clone()
    with torch.inference_mode():
        got = module(x)
        ref = linear(x)
    q, xscale = reference_quantize(x.reshape(-1, 896))
    exact = ((q.long() - 128) @ qweight.long().t()).double() * wscale.double() * xscale.double()[:, None]
    if bias:
        exact = exact + linear.bias.detach().double()
    assert got.shape == (2, 7, 200) and got.dtype == torch.float32 and module.packed is not None
    assert torch.allclose(got.reshape(-1, 200).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    # against the float layer: per-token 8-bit activations, per-channel 8-bit weights, the hot token included
    per_row = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_row.max() < 0.03, per_row


@needs_w8a8
def test_a_row_reads_the_same_whatever_its_batch():
    """Per-token scales and exact integer sums: a row's output does not depend on the other rows (batch size,
    a prefill cut by the prefix cache, a shrinking decode batch), bit for bit."""
    torch.manual_seed(2)
    module = w8a8.Int8DynamicLinear(nn.Linear(896, 1152))
    x = torch.randn(64, 896)
    x[5] *= 30
    with torch.inference_mode():
        whole = module(x)
        assert all(torch.equal(module(x[i:i + 1])[0], whole[i]) for i in (0, 5, 63))
        assert torch.equal(module(x[3:20]), whole[3:20])
        assert module(x[:0]).shape == (0, 1152)


@needs_w8a8
def test_fused_projections_equal_their_parts():
    torch.manual_seed(3)
    parts = [w8a8.Int8DynamicLinear(nn.Linear(256, n, bias=b)) for n, b in ((128, True), (64, False), (64, True))]
    fused = w8a8.Int8DynamicLinear.concatenate(parts)
    x = torch.randn(9, 256)
    with torch.inference_mode():
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert w8a8.Int8DynamicLinear.concatenate(parts) is None  # packed by the first call: nothing to fuse any more


def test_where_onednn_saturates_int8_falls_back_to_weight_only_and_says_why():
    """oneDNN capped below VNNI (ONEDNN_MAX_CPU_ISA=AVX2: the kernel an AVX2-only CPU such as Zen 3 gets) sums u8 x s8
    pairs in saturating 16 bits: the probe sees it and int8 runs weight-only, logged. In a subprocess: oneDNN reads
    the variable once."""
    code = ("import logging, torch\n"
            "from torch import nn\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "from batchgen.engines.hf.quant import int8, w8a8\n"
            "print('probe:', w8a8.probe())\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,\n"
            "                     num_attention_heads=4, num_key_value_heads=2)\n"
            "model = int8.int8_cpu(LlamaForCausalLM(config), torch.device('cpu'))\n"
            "print('module:', type(model.model.layers[0].mlp.down_proj).__name__)\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "probe: oneDNN's int8 GEMM on this CPU saturates 16-bit sums" in proc.stdout
    assert "module: Int8WeightOnlyLinear" in proc.stdout
    assert "Running int8 weight-only instead (engine.quantization=int8_wo" in proc.stderr


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("isa", ISAS or ["none"])
def test_the_fused_producers_write_the_bytes_of_the_unfused_passes_on_every_variant(isa):
    """add_rms_norm_u8 and silu_mul_u8 (the native decode step's kernels before a W8A8 GEMM) equal the passes they
    replace: the previous GEMM's row scales (scale_rows), the float kernel (add_rms_norm, silu_mul), then
    quantize_rows; bit for bit, widths with a scalar tail, a NaN row, decode-sized and prefill-sized batches."""
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        pytest.skip("batchgen's CPU kernels are not built here (x86-64 with AVX2 and FMA, a C compiler)")
    gen = torch.Generator().manual_seed(11)
    for rows, hidden, inter in ((1, 64, 136), (7, 61, 93), (130, 256, 688)):  # 130: over the parallel threshold
        x, delta = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen) * 40
        weight = torch.rand(hidden, generator=gen) + 0.5
        row_scale = torch.rand(rows, generator=gen) * 0.01
        delta[rows // 2, -1] = float("nan") if rows > 1 else delta[0, -1]
        for d, s in ((delta, row_scale), (delta, None), (None, None)):
            fused_x, plain_x = x.clone(), x.clone()
            got = cpu_ops.add_rms_norm_u8(lib, fused_x, None if d is None else d.clone(), s, weight, 1e-6)
            if d is None:
                h = cpu_ops.rms_norm(lib, plain_x, weight, 1e-6)
            else:
                scaled = d.clone() if s is None else cpu_ops.scale_rows(lib, d.clone(), s, None)
                h = cpu_ops.add_rms_norm(lib, plain_x, scaled, weight, 1e-6)
            want = cpu_ops.quantize_rows(lib, h)
            assert same_bits(fused_x, plain_x) and all(map(same_bits, got, want)), (isa, rows, hidden, s is None)
        gate_up = torch.randn(rows, 2 * inter, generator=gen) * 300
        for s in (row_scale, None):
            got = cpu_ops.silu_mul_u8(lib, gate_up.clone(), s)
            scaled = gate_up.clone() if s is None else cpu_ops.scale_rows(lib, gate_up.clone(), s, None)
            want = cpu_ops.quantize_rows(lib, cpu_ops.silu_mul(lib, scaled))
            assert all(map(same_bits, got, want)), (isa, rows, inter, s is None)


def w8a8_llama(bias: bool, scheme: str = "int8") -> nn.Module:
    """A random Llama (Qwen2's q/k/v biases where `bias`) with W8A8 linears (scheme int8; int4: W4A8 linears and a
    W8A8 LM head), fused projections, weights packed: what the engine builds for engine.quantization=int8 (int4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchgen.engines.hf import quant
    from batchgen.engines.hf.fusion import fuse_projections
    from batchgen.engines.hf.quant import int8, w4a8

    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=304, hidden_size=128, intermediate_size=344 if scheme == "int8" else 384,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, attention_bias=bias,
                         max_position_embeddings=128)
    convert = int8.int8_cpu if scheme == "int8" else w4a8.int4_cpu
    model = convert(LlamaForCausalLM(config).eval(), torch.device("cpu"))
    fuse_projections(model, quant.concatenate)
    quant.pack_w8a8(model)
    return model


def needs_scheme(scheme: str) -> None:
    from batchgen.engines.hf.quant import w4a8

    if cpu_kernels.load() is None:
        pytest.skip("batchgen's CPU kernels are not built here")
    if scheme == "int4" and not w4a8.runs_here(cpu_kernels.load()):
        pytest.skip("batchgen's W4A8 GEMM does not run here (no avx512_vnni, or no AVX-512 kernels)")


@needs_w8a8
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_native_step_with_fused_quantization_equals_the_unfused_one(bias, scheme):
    """The decode step (and the prefill) with the quantization and row scales folded into batchgen's kernels gives the
    logits of the same step calling each W8A8 (W4A8) linear whole (quantize, GEMM, scale rows), bit for bit: prompts
    of different lengths, several decode steps."""
    from batchgen.engines.hf.backends.cpu.step import CpuStepper as LlamaStepper

    needs_scheme(scheme)
    model = w8a8_llama(bias, scheme)
    fused, plain = LlamaStepper(model, torch.float32), LlamaStepper(model, torch.float32)
    assert fused.native_step and fused.gemm_inputs[0] == (torch.uint8,) * 4 and fused.head_input == torch.uint8
    assert "W8A8" in fused.describe()
    plain.gemm_inputs = [(torch.float32,) * 4 for _ in plain.gemm_inputs]  # each linear quantizes its own input
    plain.head_input = torch.float32
    prompts = [[5, 9, 200, 17, 3], [44, 2], [7] * 11]
    logits = []
    with torch.inference_mode():
        for stepper in (fused, plain):
            cache = stepper.new_cache(slots=3, max_len=32)
            steps = [stepper.prefill(cache, 0, prompts)]
            for token in (1, 77, 250):
                step, picks = stepper.decode_picks(cache, torch.tensor([token, token + 1, token + 2]))
                # the W8A8 LM head's one-pass scaling gives the greedy picks too; the unfused step leaves them to
                # the sampler
                assert (picks is None) == (stepper is plain)
                assert picks is None or torch.equal(picks, step.max(dim=-1).indices)
                steps.append(step)
            logits.append(steps)
    assert all(same_bits(a, b) for a, b in zip(*logits))
    # and against the model's own forward (transformers' modules calling each W8A8 linear): the same tokens, up to
    # rounding (float sums in another order can move an activation across a quantization step: seen at 0.2% of the
    # largest logit with the AVX2 kernels, 2e-7 with AVX-512's)
    want = model(torch.tensor([prompts[1] + [2, 78, 251]])).logits[0, -1].float()
    assert torch.allclose(logits[0][-1][1], want, atol=0.01 * want.abs().max().item(), rtol=0)


@needs_w8a8
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_with_w8a8_a_rows_logits_do_not_depend_on_the_rows_beside_it(scheme):
    """Exact int32 GEMMs (W4A8: exact per group, folded in a fixed order), per-row kernels and per-row prefill
    attention: a row prefilled and decoded alone, or beside longer and shorter rows (padded prefill batches of other
    widths), gets the same logits at every step, bit for bit. (Before prefill attention ran per row, a row beside a
    longer one differed by an ulp at one step.)"""
    from batchgen.engines.hf.backends.cpu.step import CpuStepper as LlamaStepper

    needs_scheme(scheme)
    stepper = LlamaStepper(w8a8_llama(False, scheme), torch.float32)
    assert stepper.row_exact
    gen = torch.Generator().manual_seed(1)
    row = torch.randint(3, 290, (23,), generator=gen).tolist()

    def run(rows: list[list[int]]) -> list[torch.Tensor]:
        cache = stepper.new_cache(slots=len(rows), max_len=128)
        logits = stepper.prefill(cache, 0, rows)
        seen = [logits[0]]
        for _ in range(20):
            logits = stepper.decode(cache, logits.argmax(-1))
            seen.append(logits[0])
        return seen

    with torch.inference_mode():
        alone = run([row])
        for other in (5, 23, 40, 77):
            beside = run([row, torch.randint(3, 290, (other,), generator=gen).tolist()])
            assert [i for i, (a, b) in enumerate(zip(alone, beside)) if not same_bits(a, b)] == [], other


@pytest.mark.parametrize("isa", ISAS or ["none"])
def test_the_argmax_kernel_picks_what_torch_max_does_on_every_variant(isa):
    """Greedy picks on CPU (cpu/backend.py argmax_rows, the platform's draw ops): the first largest value's index, a
    NaN counting as largest, equal to torch's max(dim=-1).indices: ties, NaN in the vector body and in the tail, all
    -inf, short rows, a wide vocabulary split over threads."""
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        pytest.skip("batchgen's CPU kernels are not built here (x86-64 with AVX2 and FMA, a C compiler)")
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(64, 151936, generator=gen)
    ties = torch.randint(0, 3, (9, 37), generator=gen).float()  # many equal maxima, in several lanes
    odd = torch.randn(6, 21, generator=gen)
    odd[1, 3], odd[2, 19], odd[3, 5], odd[3, 17] = float("nan"), float("nan"), float("inf"), float("nan")
    odd[4] = float("-inf")
    odd[5, 2] = odd[5, 11] = 50.0
    for x in (wide, ties, odd, torch.randn(3, 1, generator=gen), torch.randn(2, 7, generator=gen),
              torch.randn(1, 8, generator=gen), torch.full((2, 16), float("-inf"))):
        got = cpu_ops.argmax_rows(lib, x.contiguous())
        assert torch.equal(got, x.max(dim=-1).indices), (isa, tuple(x.shape))


@pytest.mark.parametrize("isa", ISAS or ["none"])
def test_scaling_and_picking_in_one_pass_equals_the_two_kernels_on_every_variant(isa):
    """scale_rows_argmax (a W8A8 LM head's row scales and the greedy picks, a row at a time) writes the values
    scale_rows writes and picks what argmax_rows picks from them: scales that round neighbours into ties, a bias, NaN
    rows, a wide vocabulary, short rows."""
    lib = cpu_kernels.load(isa) if isa != "none" else None
    if lib is None:
        pytest.skip("batchgen's CPU kernels are not built here (x86-64 with AVX2 and FMA, a C compiler)")
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(64, 151936, generator=gen) * 1e4
    odd = torch.randn(5, 21, generator=gen)
    odd[1, 3], odd[2, 19] = float("nan"), float("nan")
    odd[3, 5] = odd[3, 6] * (1 + 2 ** -22)  # one ulp-ish apart: a tiny scale can round them equal
    for x in (wide, odd, torch.randn(3, 1, generator=gen), torch.randn(2, 7, generator=gen)):
        scale = torch.rand(x.shape[0], generator=gen) * 1e-3
        scale[0] = 1e-38  # neighbours rounded together (and to subnormals)
        for bias in (None, torch.randn(x.shape[1], generator=gen)):
            want = cpu_ops.scale_rows(lib, x.clone(), scale, bias)
            y = x.clone()
            picks = cpu_ops.scale_rows_argmax(lib, y, scale, bias)
            assert same_bits(y, want), (isa, tuple(x.shape), bias is None)
            assert torch.equal(picks, cpu_ops.argmax_rows(lib, want)), (isa, tuple(x.shape), bias is None)


@pytest.mark.parametrize("which", ["amx", "vnni"])
def test_batchgens_int8_gemms_give_onednns_bits(which):
    """batchgen's AMX int8 GEMM (the avx512_amx variant) and its AVX-512 VNNI one (every AVX-512 variant, on a CPU
    with avx512_vnni): the float32 output of oneDNN's int8 matmul bit for bit, and the exact integer products times
    the channel scales: row counts around the AMX 16-row tiles and the VNNI 6-row tiles (1 to 7, 12, 15, 16, 17, 33,
    64, 130: both AMX loop orders), channel counts not a multiple of the 64-channel tile, rows with and without
    padded storage, extreme bytes."""
    from batchgen.engines.hf.backends.cpu import int8_gemm

    isa = "avx512_amx" if which == "amx" else "avx512"
    lib = cpu_kernels.load(isa) if isa in ISAS else None
    if int8_gemm.kernel(lib, 32, 64) != which:
        pytest.skip(f"batchgen's {which} int8 GEMM does not run here (CPU flags, compiler, or Linux refused AMX)")
    gen = torch.Generator().manual_seed(8)
    shapes = [(32, 64), (96, 256), (1152, 896)] + ([(48, 148), (80, 900)] if which == "vnni" else [])  # VNNI: K % 4
    for n, k in shapes:
        weight = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        weight[0], weight[-1, ::2] = 127, -127
        scale = torch.rand(n, generator=gen) / 50
        packed, comp = int8_gemm.pack(weight)
        onednn = torch.ops.onednn.qlinear_prepack(weight, None)
        for m in (1, 2, 3, 4, 5, 6, 7, 12, 15, 16, 17, 33, 64, 130):
            q = torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8)
            q[0] = 255
            for rows in (q, cpu_ops.u8_rows(m, k).copy_(q)):  # storage of m rows (copied inside), of 16-row tiles
                got = int8_gemm.gemm(lib, which, rows, packed, comp, scale)
                want = w8a8._gemm(q, onednn, scale, torch.zeros(n, dtype=torch.int64))
                exact = ((q.int() - 128) @ weight.int().t()).float() * scale
                assert same_bits(got, want) and same_bits(got, exact), (n, k, m)


def test_the_w4a8_gemm_is_the_int4_weights_times_the_quantized_rows():
    """batchgen's W4A8 GEMM (kernels_vnni.c): the int4 weights quant/int4.py quantizes (scale and min per group of
    64) times the rows' int8 values, summed exactly per group and folded in float32: within float32 rounding of the
    float64 product of the dequantized weights and the rows, at row tails (1 to 7, 13, 64) and channel tails (16, 48,
    80, 1152 channels), K of one and several groups."""
    from batchgen.engines.hf.quant.int4 import quantize_int4
    from batchgen.engines.hf.quant.w4a8 import Int4DynamicLinear, runs_here

    lib = cpu_kernels.load()
    if not runs_here(lib):
        pytest.skip("batchgen's W4A8 GEMM does not run here (no avx512_vnni, or no AVX-512 kernels)")
    gen = torch.Generator().manual_seed(4)
    for n, k in ((16, 64), (48, 128), (80, 256), (1152, 896)):
        linear = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        q, scale, mins = quantize_int4(linear.weight, 64)
        dequantized = (q.double().view(n, k // 64, 64) * scale.double()[..., None] + mins.double()[..., None])
        module = Int4DynamicLinear(linear)
        for m in (1, 2, 3, 4, 5, 6, 7, 13, 64):
            rows = w8a8.QuantizedRows(torch.randint(0, 256, (m, k), generator=gen, dtype=torch.uint8),
                                 torch.ones(m))
            rows.q[0] = 255
            got = module.matmul(rows).double()
            want = (rows.q.double() - 128) @ dequantized.reshape(n, k).t()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (n, k, m)
