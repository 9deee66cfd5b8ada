"""batchgen's native CPU kernels: built once into the cache per ISA variant, picked from the CPU's flags or forced
narrower, never a reason for a job to fail; and the decode-step kernels against torch under every variant the CPU
runs (float32 and bf16 inputs, outputs and KV cache)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops

ISAS = cpu_kernels.supported_isas()
every_isa = pytest.mark.parametrize("isa", ISAS or ["none"])


def kernels(isa: str):
    """The library of `isa`; skipped only where this CPU runs no variant (not x86-64 with AVX2 and FMA) or there
    is no C compiler."""
    lib = cpu_kernels.load(isa) if isa in ISAS else None
    if lib is None:
        pytest.skip("no variant of batchgen's CPU kernels runs here (x86-64 with AVX2 and FMA, and a C compiler)")
    return lib


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the session's library is back afterwards."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    cpu_kernels.reset()
    yield tmp_path
    cpu_kernels.reset()


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("BATCHGEN_NATIVE_KERNELS", "0")
    assert cpu_kernels.load() is None and not list(fresh.iterdir())


def test_no_compiler_means_torch_kernels(fresh, monkeypatch, caplog):
    """On a CPU that takes the kernels, a missing compiler (not the CPU) is why none load: logged as such."""
    if not cpu_kernels.wanted():
        pytest.skip("this CPU runs no variant of batchgen's kernels: no compiler would be asked")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "no C compiler" in caplog.text and not list(fresh.iterdir())


def test_a_failing_compile_is_logged_not_raised(fresh, monkeypatch, caplog):
    if not cpu_kernels.wanted():
        pytest.skip("this CPU runs no variant of batchgen's kernels (x86-64 with AVX2 and FMA)")
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "building batchgen's CPU kernels failed" in caplog.text
    assert not list(fresh.iterdir())  # no half-written library left behind


@every_isa
def test_each_variant_is_built_once_then_loaded_from_the_cache(fresh, isa):
    lib = kernels(isa)
    assert lib.batchgen_isa().decode() == isa
    built = list(fresh.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and f"-{isa}-" in built[0].name
    stamp = built[0].stat().st_mtime_ns
    cpu_kernels.reset()
    assert cpu_kernels.load(isa) is not None and built[0].stat().st_mtime_ns == stamp


def test_every_source_and_the_header_key_the_build(monkeypatch, tmp_path):
    """The library is built from every kernels_*.c in the folder, and a change to any of them or to the header is
    another cache key (a rebuild), as is another variant's flags."""
    assert sorted(cpu_kernels.SOURCES) == sorted(cpu_kernels.HERE.glob("kernels_*.c")) and cpu_kernels.HEADER.exists()
    files = (*cpu_kernels.SOURCES, cpu_kernels.HEADER)
    for path in files:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(tmp_path / path.name for path in cpu_kernels.SOURCES))
    monkeypatch.setattr(cpu_kernels, "HEADER", tmp_path / cpu_kernels.HEADER.name)
    flags = cpu_kernels.ISAS["avx2"][1]
    keys = [cpu_kernels.source_digest(flags)]
    assert cpu_kernels.source_digest(flags) == keys[0]
    for path in files:
        copy = tmp_path / path.name
        copy.write_bytes(copy.read_bytes() + b"\n")
        keys.append(cpu_kernels.source_digest(flags))
    assert len(set(keys)) == len(files) + 1
    assert cpu_kernels.source_digest(cpu_kernels.ISAS["avx512"][1]) not in keys


def test_the_widest_variant_by_default_and_a_narrower_one_when_forced(fresh, monkeypatch, caplog):
    if not ISAS:
        pytest.skip("this CPU runs no variant of batchgen's kernels (x86-64 with AVX2 and FMA)")
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    assert cpu_kernels.selected_isa() == ISAS[-1]
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels.selected_isa() == "avx2"
    if cpu_kernels.load() is not None:
        assert cpu_kernels.load().batchgen_isa() == b"avx2"
    cpu_kernels.reset()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx9000")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.selected_isa() == ISAS[-1]
    assert "unknown variant" in caplog.text and "avx9000" in caplog.text


def test_variants_follow_the_cpu_flags(monkeypatch):
    """What each kind of CPU gets, from its /proc/cpuinfo flags (tools/as-cpu narrows them for whole runs)."""
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    zen4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
    for flags, want in [(zen4, ["avx2", "avx512", "avx512_bf16"]), (zen4 - {"avx512_bf16"}, ["avx2", "avx512"]),
                        ({"avx2", "fma"}, ["avx2"]), ({"avx", "sse4_2"}, [])]:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_kernels.supported_isas() == want
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert cpu_kernels.supported_isas() == []


@every_isa
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_decode_layer_attention_matches_torch(isa, kv, out_dtype):
    """Rotary embedding (bit for bit transformers'), the cache write (rounded once to a bf16 cache) and attention
    of each row over its own positions, against torch, for head sizes of 64 and 80 (the 16-wide and 8-wide paths)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lib = kernels(isa)
    torch.manual_seed(0)
    for n, heads, kv_heads, d, positions in [(3, 4, 2, 64, [0, 3, 40]), (2, 6, 2, 80, [17, 5])]:
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d)
        cos, sin = torch.randn(n, d), torch.randn(n, d)
        k = torch.randn(n, kv_heads, 48, d).to(kv)
        v = torch.randn(n, kv_heads, 48, d).to(kv)
        pos = torch.tensor(positions)
        q_want, k_want = apply_rotary_pos_emb(qkv[:, :heads * d].view(n, heads, 1, d),
                                              qkv[:, heads * d:(heads + kv_heads) * d].view(n, kv_heads, 1, d),
                                              cos[:, None], sin[:, None], unsqueeze_dim=1)
        values = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
        k_ref, v_ref = k.clone(), v.clone()
        k_ref[torch.arange(n), :, pos], v_ref[torch.arange(n), :, pos] = k_want[:, :, 0].to(kv), values.to(kv)
        out = cpu_ops.decode_layer_attention(lib, qkv.clone(), cos, sin, k, v, pos, heads, 0.1, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(k[torch.arange(n), :, pos], k_ref[torch.arange(n), :, pos])  # rounded as torch rounds
        assert torch.equal(v[torch.arange(n), :, pos], v_ref[torch.arange(n), :, pos])
        for r in range(n):
            keys, vals = k_ref[r, :, :pos[r] + 1].float(), v_ref[r, :, :pos[r] + 1].float()
            query = q_want[r, :, 0].view(kv_heads, heads // kv_heads, d)
            probs = torch.softmax(query @ keys.transpose(-1, -2) * 0.1, dim=-1)
            want = (probs @ vals).reshape(-1)
            tol = 1e-5 if out_dtype == torch.float32 else 1e-2
            assert torch.allclose(out[r].float(), want, atol=tol, rtol=tol), (isa, r)


@every_isa
def test_decode_layer_attention_reads_a_bf16_projection_as_its_widened_values(isa):
    """A bf16 qkv (a bf16 GEMM's output, read without a conversion pass) gives bit for bit what its float32 widening
    gives: the same cache writes, the same attention."""
    lib = kernels(isa)
    torch.manual_seed(1)
    for n, heads, kv_heads, d, positions in [(4, 12, 4, 64, [0, 9, 31, 2]), (2, 6, 2, 80, [17, 5])]:
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d).to(torch.bfloat16)
        cos, sin = torch.randn(n, d), torch.randn(n, d)
        pos = torch.tensor(positions)
        outs = []
        for given in (qkv, qkv.float()):
            k = torch.zeros(n, kv_heads, 40, d, dtype=torch.bfloat16)
            v = torch.zeros_like(k)
            out = cpu_ops.decode_layer_attention(lib, given.clone(), cos, sin, k, v, pos, heads, 0.125,
                                                     torch.bfloat16)
            outs.append((out, k, v))
        for got, want in zip(*outs):
            assert torch.equal(got, want), isa


@every_isa
@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_the_norm(isa, delta_dtype, out_dtype):
    """The fused residual add and RMSNorm: x becomes x + delta (a bf16 delta widened exactly) and the output is
    rms_norm of that sum, bit for bit, for decode rows and a prefill's many rows (threaded)."""
    lib = kernels(isa)
    torch.manual_seed(0)
    for rows, hidden in [(5, 100), (64, 768), (300, 768)]:
        x, weight = torch.randn(rows, hidden), torch.randn(hidden)
        delta = torch.randn(rows, hidden).to(delta_dtype)
        want_x = x + delta.float()
        want = cpu_ops.rms_norm(lib, want_x, weight, 1e-6, out_dtype)
        got = cpu_ops.add_rms_norm(lib, x, delta, weight, 1e-6, out_dtype)
        assert torch.equal(x, want_x) and torch.equal(got, want), (isa, rows, hidden)


@every_isa
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_match_torch_in_either_dtype(isa, out_dtype):
    """Decode rows and a prefill's many rows (threaded), widths with and without a remainder of the 8-wide loop;
    bf16 outputs rounded to nearest even, as torch rounds."""
    lib = kernels(isa)
    torch.manual_seed(0)
    for rows, hidden in [(5, 100), (3, 64), (300, 768)]:
        x, weight = torch.randn(rows, hidden), torch.randn(hidden)
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        got = cpu_ops.rms_norm(lib, x, weight, 1e-6, out_dtype)
        assert got.dtype == out_dtype
        if out_dtype == torch.float32:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        else:  # rounded from the float32 result: at most one bf16 step from torch's rounding of torch's result
            assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
        for in_dtype in (torch.float32, torch.bfloat16):
            gate_up = (torch.randn(rows, 2 * hidden) * 10).to(in_dtype)
            g, u = gate_up.float().chunk(2, dim=-1)
            want = torch.nn.functional.silu(g) * u
            got = cpu_ops.silu_mul(lib, gate_up, out_dtype)
            assert got.dtype == out_dtype
            tol = 1e-5 if out_dtype == torch.float32 else 1e-2
            assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (isa, rows, hidden, in_dtype)


@every_isa
def test_bf16_rounding_is_torchs_round_to_nearest_even(isa):
    """The kernels' float32 -> bf16 stores against torch's conversion, on values at and around rounding ties: the
    new values of a decode step go into a bf16 cache unchanged by any arithmetic."""
    lib = kernels(isa)
    torch.manual_seed(0)
    n, heads, kv_heads, d = 4, 2, 1, 64
    bits = (torch.randn(n, d) * 3).view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000  # exactly half-way between two bf16 values
    values = torch.stack([ties, ties + 1, ties - 1, bits]).view(torch.float32)[:, 0]  # [n, d]
    qkv = torch.cat([torch.randn(n, (heads + kv_heads) * d), values], dim=1)
    k = torch.zeros(n, kv_heads, 4, d, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    cpu_ops.decode_layer_attention(lib, qkv, torch.ones(n, d), torch.zeros(n, d), k, v,
                                       torch.zeros(n, dtype=torch.long), heads, 0.1)
    assert torch.equal(v[:, 0, 0], values.to(torch.bfloat16))


@every_isa
def test_a_layout_the_kernels_do_not_expect_is_refused_even_under_python_O(isa):
    """The kernels write through raw pointers: wrong layouts raise ValueError by explicit checks (asserts would
    vanish under -O), e.g. a non-contiguous input or a cache of another dtype for v than for k."""
    lib = kernels(isa)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_ops.rms_norm(lib, torch.randn(8, 4).t(), torch.randn(8), 1e-6)
    k = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="decode_layer_attention"):
        cpu_ops.decode_layer_attention(lib, torch.randn(1, 48), torch.randn(1, 16), torch.randn(1, 16), k,
                                           k.to(torch.bfloat16), torch.tensor([0]), 1, 0.25)


# The kernels before issue 29 part 7 split them by family: one file, every kernel written per lane width.
PRE_SPLIT = "batchgen/engines/hf/cpu/kernels.c"


def pre_split_source() -> str:
    """The pre-split kernels.c from git history: the version before the commit that deleted it (or HEAD's, before
    that commit exists). Skips, saying why, where there is no git, no repository or not that history (a shallow
    clone, an unpacked sdist)."""
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git here: the pre-split kernels.c comes from git history")
    root = Path(cpu_kernels.__file__).resolve().parents[5]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([git, "-C", str(root), *args], capture_output=True, text=True, timeout=60)

    if run("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip(f"{root.name} is not a git work tree: no history to take the pre-split kernels.c from")
    deleted = run("log", "-1", "--format=%H", "--diff-filter=D", "--", PRE_SPLIT).stdout.strip()
    shown = run("show", f"{deleted}^:{PRE_SPLIT}" if deleted else f"HEAD:{PRE_SPLIT}")
    if shown.returncode != 0:
        pytest.skip(f"the pre-split {PRE_SPLIT} is not in this repository's history ({shown.stderr.strip()})")
    return shown.stdout


@pytest.fixture(scope="module")
def pre_split(tmp_path_factory):
    """isa -> the pre-split kernels.c built as that variant (with today's flags), declared as the loader does."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        pytest.skip("no C compiler (cc or $CC)")
    folder = tmp_path_factory.mktemp("pre_split")
    source = folder / "kernels.c"
    source.write_text(pre_split_source())
    built: dict[str, ctypes.CDLL] = {}

    def build(isa: str) -> ctypes.CDLL:
        if isa not in built:
            target = folder / f"pre_split-{isa}.so"
            cpu_kernels._compile(compiler, target, cpu_kernels.ISAS[isa][1], (source,))
            built[isa] = cpu_kernels.declare(ctypes.CDLL(str(target)))
        return built[isa]

    return build


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included): the raw bytes of equal shapes and dtypes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Compare:
    """The split library and the pre-split one of one variant, fixed random inputs, and `both`, which runs a kernel
    on each and asserts the same bits."""

    def __init__(self, isa: str, new: ctypes.CDLL, old: ctypes.CDLL):
        self.isa, self.libs, self.gen = isa, (new, old), torch.Generator().manual_seed(29)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def randint(self, low: int, high: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen, dtype=dtype)

    def both(self, fn, *args, mutated: tuple[int, ...] = ()) -> None:
        """fn on each library with copies of args: its output and every argument in `mutated` (written in place)
        bit for bit alike."""
        got = []
        for lib in self.libs:
            copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            got.append([fn(lib, *copies), *(copies[i] for i in mutated)])
        shapes = [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        for i, (a, b) in enumerate(zip(*got)):
            assert same_bits(a, b), (self.isa, fn.__name__, shapes, "output" if i == 0 else f"arg {mutated[i - 1]}")


PRE_SPLIT_NAMES = {"avx512_amx": "avx512_bf16"}


@pytest.fixture(params=ISAS or ["none"])
def compare(request):
    """Each variant this CPU (as /proc/cpuinfo shows it) runs: its split build (kernels.load, as a job loads it) and
    the pre-split kernels.c built as the same variant; two OpenMP threads, the kernels' loops split as in a job."""
    isa = request.param
    if isa == "none":
        pytest.skip("this CPU (as /proc/cpuinfo shows it) runs no variant of batchgen's kernels (x86-64 with AVX2 "
                    "and FMA): torch's operations run, there is nothing to compare")
    new, old = kernels(isa), request.getfixturevalue("pre_split")(isa)
    # the pre-split source predates the avx512_amx variant: built with its flags it names itself avx512_bf16
    assert new.batchgen_isa().decode() == isa and old.batchgen_isa().decode() == PRE_SPLIT_NAMES.get(isa, isa)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield Compare(isa, new, old)
    torch.set_num_threads(threads)


# The split sources (kernels_*.c over kernels_simd.h) against the one-file kernels.c they came from, built as the
# same variant, on fixed random inputs with tails: K not a multiple of 8 or 16, N not a multiple of 4, odd rows,
# cache lengths off the vector width; float32 and bf16 inputs, outputs and caches.

def test_split_gemms_give_the_pre_split_bits(compare):
    for m, k, n in [(1, 64, 4), (1, 100, 7), (2, 256, 12), (3, 23, 5), (5, 1000, 9), (8, 768, 64), (17, 130, 33)]:
        x, q = compare.randn(m, k), compare.randint(-127, 128, (n, k), torch.int8)
        scale, bias = compare.randn(n).abs() / 64, compare.randn(n)
        compare.both(cpu_ops.int8_gemm, x, q, scale, bias)
        compare.both(cpu_ops.int8_gemm, x, q, scale, None)
    for m, k, n, group in [(1, 64, 4, 64), (1, 256, 7, 64), (1, 512, 9, 128), (2, 128, 5, 64), (3, 256, 12, 128),
                           (7, 384, 13, 64), (32, 768, 16, 128)]:
        x, packed = compare.randn(m, k), compare.randint(0, 256, (n, k // 2), torch.uint8)
        scale = (compare.randn(n, k // group).abs() / 8).to(torch.bfloat16)
        mins = (compare.randn(n, k // group) / 4).to(torch.bfloat16)
        compare.both(cpu_ops.int4_gemm, x, packed, scale, mins, group, compare.randn(n))
        compare.both(cpu_ops.int4_gemm, x, packed, scale, mins, group, None)
        compare.both(cpu_ops.int4_dequantize, packed, scale, mins, group)


def test_split_norms_and_activations_give_the_pre_split_bits(compare):
    """Decode rows on one thread and a prefill's rows (128 and more) split over threads."""
    for rows, hidden in [(1, 8), (3, 13), (5, 100), (64, 768), (130, 200), (300, 64)]:
        x, weight = compare.randn(rows, hidden, scale=3.0), compare.randn(hidden)
        for out in (torch.float32, torch.bfloat16):
            compare.both(cpu_ops.rms_norm, x, weight, 1e-6, out)
            for delta in (torch.float32, torch.bfloat16):
                compare.both(cpu_ops.add_rms_norm, x, compare.randn(rows, hidden).to(delta), weight, 1e-5, out,
                             mutated=(0,))
            for gate_up in (torch.float32, torch.bfloat16):
                compare.both(cpu_ops.silu_mul, compare.randn(rows, 2 * hidden, scale=8.0).to(gate_up), out)


def test_split_attention_gives_the_pre_split_bits(compare):
    """Head sizes that take the 16-wide attention in the AVX-512 variants (64, 128, 48) and the 8-wide one (8, 24,
    80); the layer kernel (rotary embedding, cache write, attention) for head sizes of multiples of 16, with the
    rotated qkv and the written caches compared too."""
    for n, heads, kv_heads, d, lengths in [(3, 4, 2, 64, [1, 7, 40]), (2, 6, 2, 80, [17, 5]),
                                           (4, 8, 8, 8, [1, 2, 9, 33]), (2, 9, 3, 24, [15, 16]),
                                           (3, 12, 4, 128, [3, 31, 64]), (1, 4, 1, 48, [100])]:
        cache = max(lengths) + 4
        k, v = compare.randn(n, kv_heads, cache, d), compare.randn(n, kv_heads, cache, d)
        compare.both(cpu_ops.decode_attention, compare.randn(n, heads, d), k, v, torch.tensor(lengths),
                     1 / d ** 0.5)
        if d % 16:
            continue
        qkv, cos, sin = compare.randn(n, (heads + 2 * kv_heads) * d), compare.randn(n, d), compare.randn(n, d)
        for qkv_dtype in (torch.float32, torch.bfloat16):
            for kv in (torch.float32, torch.bfloat16):
                for out in (torch.float32, torch.bfloat16):
                    compare.both(cpu_ops.decode_layer_attention, qkv.to(qkv_dtype), cos, sin, k.to(kv), v.to(kv),
                                 torch.tensor(lengths) - 1, heads, 0.125, out, mutated=(0, 3, 4))


@every_isa
def test_the_draw_halves_kernel_gives_the_draws_values_bit_for_bit(isa):
    """batchgen_draw_halves (the CPU platform's DrawOps.halves) equals sampling/draw.py's torch halves for 64-bit
    seeds, huge steps and vocabularies of 1 to 151,936 (threads split the rows), so its draws are the same tokens."""
    from batchgen.engines.hf.sampling import draw

    lib = kernels(isa)
    seeds = torch.tensor([draw.as_int64(2 ** 64 - 5), 0, 7, 2 ** 62, -1, 123456789012345] * 3)
    steps = torch.tensor([3, 0, 2 ** 40, 1, 99, 5] * 3) + torch.arange(18)
    key1, key2 = draw.row_keys(seeds, steps)
    for vocab in (1, 17, 1000, 151936):
        assert torch.equal(cpu_ops.draw_halves(lib, key1, key2, vocab), draw.halves_of_keys(key1, key2, vocab))


@every_isa
def test_the_sort_kernel_gives_torchs_stable_descending_sort_bit_for_bit(isa):
    """batchgen_sort_desc_rows (the CPU platform's DrawOps.sort, the draw's top-k/top-p/min-p filter) gives
    torch.sort(descending=True, stable=True)'s values and indices: ties in index order (-0 equal to +0), NaN first,
    infinities, rows of 1 to 151,936 values, one row and many (threads split the rows)."""
    lib = kernels(isa)
    gen = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1.5, -1.5, 1e-45, -1e-45])
    for rows, vocab in ((1, 1), (3, 17), (1, 32000), (8, 32000), (2, 151936)):
        x = (torch.randn(rows, vocab, generator=gen) * 3).round(decimals=1)  # many ties
        x.view(-1)[torch.randint(rows * vocab, (min(rows * vocab, 40),), generator=gen)] = special.repeat(5)[
            :min(rows * vocab, 40)]
        values, order = cpu_ops.sort_desc_rows(lib, x)
        want = torch.sort(x, dim=-1, descending=True, stable=True)
        assert torch.equal(order, want.indices)
        assert torch.equal(values.view(torch.int32), want.values.view(torch.int32))  # -0 and +0 as they were
