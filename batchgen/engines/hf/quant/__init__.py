"""Weight quantization for the hf engine: one handler per `engine.quantization` scheme.

A scheme says which devices and compute dtypes it runs on, what `from_pretrained` needs to load it
(bitsandbytes quantizes while loading) and how to convert an already loaded model (torch's and
torchao's kernels convert after loading). The engine calls `check` while validating the config and
`load_model` instead of `from_pretrained`. Optional libraries (torchao, bitsandbytes) are imported
only by the scheme that needs them, behind an install hint. Knows modules and tensors; nothing about
requests, batching or the scheduler. This module is the registry (schemes, checks, loading; bitsandbytes,
which quantizes while loading, is only load arguments); int8.py and int4.py hold the schemes' modules and
conversions, common.py the thresholds and hints they share.

What runs where (see docs/engines.md "Quantization" and docs/performance.md "Quantization"):
- int8, CPU: W8A8, `w8a8.Int8DynamicLinear`: int8 weights per output channel reordered once for the GEMM that runs
  them, activations quantized per token on each call (batchgen's kernel), int8 GEMMs with int32 sums (batchgen's on
  AMX or AVX-512 VNNI, cpu/int8_gemm.py; oneDNN's elsewhere), every linear the LM head included. Where oneDNN's
  int8 GEMM is not exact here (no VNNI or AMX: its 16-bit pair sums saturate; w8a8.probe checks), int8 runs as
  int8_wo, with a warning.
- int8_wo, CPU: weight-only, `Int8WeightOnlyLinear`: int8 weights with one symmetric bf16-rounded scale per output
  channel; activations stay unquantized. Inputs under NATIVE_ROWS rows (decode steps of small batches) run
  batchgen's own AVX2 kernel (`cpu_kernels`, float32 activations) where it is built; otherwise inputs under
  DEQUANT_ROWS rows run torch's `aten._weight_int8pack_mm` with bfloat16 activations; larger inputs (prefill, large
  batches) dequantize the layer's weights for one float32 GEMM. The model (norms, attention) computes in float32.
  Without batchgen's kernel, linears whose input size aten's kernel cannot take stay float. Without either kernel
  (older torch) the fallback, with a warning, is `torch.ao.quantization.quantize_dynamic` (activations quantized
  per tensor: lower fidelity).
- int8 and int8_wo, CUDA: torchao `Int8WeightOnlyConfig` (W8A8 on CUDA is not built yet).
- int4, CPU with AVX-512 VNNI: W4A8, `w4a8.Int4DynamicLinear`: the weight-only scheme's int4 weights, activations
  quantized per token as W8A8's, batchgen's VNNI kernel; the LM head W8A8. Elsewhere:
- int4, CPU: weight-only, `Int4WeightOnlyLinear`: group-wise asymmetric int4 (a bf16 scale and min per 64
  input weights), two weights to a byte in the layout of batchgen's AVX2 kernel (`cpu_kernels`), which runs
  inputs under INT4_NATIVE_ROWS rows in float32; larger inputs dequantize the layer's weights for a float GEMM.
  The LM head is stored as int8 (Int8WeightOnlyLinear). Where batchgen's kernels are not built: torchao
  `PrototypeInt4WeightOnlyConfig` (group 128), its kernel in bfloat16; in a float32 model each quantized linear
  is then a bf16 island (`cpu/onednn.CastLinear`) and the rest of the model computes in float32.
- int4, CUDA: torchao `Int4WeightOnlyConfig` with the tinygemm tile-packed layout, bfloat16 compute.
- bnb-int8, bnb-nf4: bitsandbytes through `BitsAndBytesConfig`, CUDA only.
With int8, int8_wo, and with batchgen's int4, the input embedding table is stored as int8 rows with one scale per row
(`Int8Embedding`).
A scheme measured slower than the unquantized model at the CPU working batch, on the CPU kind it is built on, logs a
warning when it is built (CPU_WORKING_BATCH_VS_UNQUANTIZED).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.quant.common import (
    BNB_HINT,
    DEQUANT_ROWS,
    INT4_NATIVE_ROWS,
    NATIVE_ROWS,
    TORCHAO_HINT,
    import_or_hint,
)
from batchgen.engines.hf.quant.int4 import Int4WeightOnlyLinear, int4_cuda
from batchgen.engines.hf.quant.int8 import Int8WeightOnlyLinear, int8_cpu, int8_cuda, int8_wo_cpu
from batchgen.engines.hf.quant.w4a8 import Int4DynamicLinear, int4_cpu
from batchgen.engines.hf.quant.w8a8 import Int8DynamicLinear
from batchgen.engines.hf.quant.w8a8 import pack_all as pack_w8a8  # noqa: F401 (the engine's name for it)
from batchgen.errors import ModelLoadError

log = logging.getLogger(__name__)

# Output tokens/s at the CPU working batch (64 rows) over the unquantized model's at engine.dtype=auto, per CPU kind
# (cpu_kind), measured with benchmarks/quantization.py (docs/performance.md): on the AVX2 EPYC against float32, on
# the Zen 4 EPYC (AVX-512 BF16) against bf16 GEMMs with float32 kernels between them. A scheme under 0.9 on the CPU
# kind it is built on logs a warning with the figure: the engine does not switch schemes on its own, it says so.
# A kind without figures (not measured) logs nothing. torchao: the fallback's figure, where batchgen's kernels are
# not built.
CPU_WORKING_BATCH_VS_UNQUANTIZED: dict[str, dict[str, float]] = {
    "avx2": {"int8_wo": 0.90, "int4": 0.81, "int4-torchao": 0.56},  # median of 3 repeats
    # int8_wo and int4 (weight-only): one repeat; torchao's int4 not measured there. int8 (W8A8) and int4-w4a8 with
    # batchgen's VNNI kernel: a Zen 5 EPYC, Qwen2.5-0.5B shape, 2 repeats
    "avx512_bf16": {"int8_wo": 0.70, "int4": 0.65, "int8": 1.78, "int4-w4a8": 1.48},
    # a Xeon with AMX (bf16 GEMMs on AMX tiles), Qwen2.5-0.5B shape, 2 repeats; int8 (W8A8) measured 1.30x there
    "amx": {"int8_wo": 0.25, "int4": 0.23},
}


# Schemes whose CPU linears are batchgen's modules (fused q/k/v and gate/up like the float model's)
CPU_KERNEL_SCHEMES = ("int8", "int8_wo", "int4")


@dataclass(frozen=True, slots=True)
class Scheme:
    """One value of `engine.quantization` for the hf engine."""

    name: str
    dtypes: dict[str, tuple[str, ...]]  # device type -> compute dtypes it runs in, preferred first
    requires: str  # the optional package it imports (torchao, bitsandbytes) or "" for none
    load_kwargs: Optional[Callable[[torch.dtype], dict[str, Any]]] = None  # extra from_pretrained kwargs
    why_not: dict[str, str] = field(default_factory=dict)  # device type -> why it does not run there

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.dtypes)


def route_rows(model: nn.Module, native_rows: Optional[int] = None, dequant_rows: Optional[int] = None) -> int:
    """Set which kernel each int8/int4 weight-only linear of `model` runs, by the number of input rows: under
    `native_rows`, batchgen's AVX2 kernel (int8: only where it is built); int8 then under `dequant_rows`, aten's
    kernel; otherwise dequantized weights and a float GEMM. None means the engine's default (NATIVE_ROWS,
    DEQUANT_ROWS; INT4_NATIVE_ROWS for int4). Tests and the benchmark use it to send every input through one
    path. Returns how many modules were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            wanted = NATIVE_ROWS if native_rows is None else native_rows
            module.native_rows = wanted if module.native is not None else 0
            module.dequant_rows = DEQUANT_ROWS if dequant_rows is None else dequant_rows
        elif isinstance(module, Int4WeightOnlyLinear):
            module.native_rows = INT4_NATIVE_ROWS if native_rows is None else native_rows
        else:
            continue
        count += 1
    return count


def scheme_in_use(model: nn.Module) -> Optional[str]:
    """What `engine.quantization=int8` resolved to on this CPU, for the engine's identity (compared on resume):
    "w8a8" where W8A8 linears run, "w4a8" where W4A8 ones do (int4); None otherwise (weight-only int8 and int4, as
    earlier versions ran them, and the rest)."""
    kinds = {type(m) for m in model.modules()}
    return "w4a8" if Int4DynamicLinear in kinds else "w8a8" if Int8DynamicLinear in kinds else None


def set_gemm_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> int:
    """The dtype the int8/int4 weight-only linears of `model` run their dequantized GEMMs in (inputs of many rows:
    prefill). bf16 on a CPU with native bf16 (where its GEMMs ran ~2.7x float32's on the benchmark's shapes); the
    kernels for few rows and the rest of the model stay float32. None: the input's dtype. Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, (Int8WeightOnlyLinear, Int4WeightOnlyLinear)):
            module.gemm_dtype = dtype
            count += 1
    return count


def concatenate(parts: list[nn.Module]) -> Optional[nn.Module]:
    """`fuse` for fusion.fuse_projections: one int8 or int4 module for parts quantized alike; else None."""
    kind = type(parts[0])
    if kind in (Int8WeightOnlyLinear, Int4WeightOnlyLinear, Int8DynamicLinear, Int4DynamicLinear):
        return kind.concatenate(parts)
    return None


# -- bitsandbytes (quantized while loading) ---------------------------------------------------------

def bnb_kwargs(kind: str) -> Callable[[torch.dtype], dict[str, Any]]:
    def kwargs(dtype: torch.dtype) -> dict[str, Any]:
        import_or_hint("bitsandbytes", BNB_HINT, f"engine.quantization=bnb-{kind}")
        from transformers import BitsAndBytesConfig

        if kind == "int8":
            return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_compute_dtype=dtype)}
    return kwargs


CUDA_ONLY = "bitsandbytes' kernels need CUDA"
SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16")}, requires=""),
    "int8_wo": Scheme("int8_wo", {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16")}, requires=""),
    "int4": Scheme("int4", {"cpu": ("bfloat16", "float32"), "cuda": ("bfloat16",)}, requires="torchao"),
    "bnb-int8": Scheme("bnb-int8", {"cuda": ("bfloat16", "float16", "float32")}, requires="bitsandbytes",
                       load_kwargs=bnb_kwargs("int8"), why_not={"cpu": CUDA_ONLY}),
    "bnb-nf4": Scheme("bnb-nf4", {"cuda": ("bfloat16", "float16", "float32")}, requires="bitsandbytes",
                      load_kwargs=bnb_kwargs("nf4"), why_not={"cpu": CUDA_ONLY}),
}
CONVERTERS = {("int8", "cpu"): int8_cpu, ("int8", "cuda"): int8_cuda, ("int8_wo", "cpu"): int8_wo_cpu,
              ("int8_wo", "cuda"): int8_cuda,
              ("int4", "cpu"): int4_cpu, ("int4", "cuda"): int4_cuda}


# -- what the config and the engine call ------------------------------------------------------------

def check(scheme_name: Optional[str], device: str, dtype: str) -> list[str]:
    """Config problems of `engine.quantization` with `engine.device` and `engine.dtype`, before any load."""
    if scheme_name is None:
        return []
    scheme = SCHEMES[scheme_name]
    kind = device_type(device)
    if kind not in scheme.dtypes:
        reason = scheme.why_not.get(kind, f"no {scheme_name} kernels for {kind}")
        where = f"engine.device={device}" + (f" (resolves to {kind}: no CUDA device)" if device == "auto" else "")
        return [f"engine.quantization={scheme_name} does not run with {where}: {reason}; "
                f"supported devices: {', '.join(scheme.devices)}"]
    problems = []
    allowed = scheme.dtypes[kind]
    if dtype != "auto" and dtype not in allowed:
        problems.append(f"engine.quantization={scheme_name} on {kind} computes in {' or '.join(allowed)}; "
                        f"engine.dtype={dtype} is not supported; choices: auto, {', '.join(allowed)}")
    package = "torchao" if scheme_name in ("int8", "int8_wo") and kind == "cuda" else scheme.requires
    if (scheme_name, kind) == ("int4", "cpu") and cpu_kernels.load() is not None:
        package = ""  # batchgen's own int4 kernel (built here, about 1 s the first time); else torchao (int4_cpu)
    if package and importlib.util.find_spec(package) is None:
        hint = BNB_HINT if package == "bitsandbytes" else TORCHAO_HINT
        problems.append(f"engine.quantization={scheme_name} on {kind} needs {package}, not installed: {hint}")
    return problems


def compute_dtype(scheme_name: Optional[str], device: torch.device, resolved: torch.dtype) -> torch.dtype:
    """The dtype to load in: the engine's own choice unless the scheme's kernels need another."""
    if scheme_name is None:
        return resolved
    allowed = [getattr(torch, name) for name in SCHEMES[scheme_name].dtypes[device.type]]
    if resolved in allowed:
        return resolved
    log.info("quantization %s on %s computes in %s (engine.dtype=auto would pick %s without it)",
             scheme_name, device.type, allowed[0], resolved)
    return allowed[0]


def load_model(path: str, *, scheme_name: Optional[str], device: torch.device, dtype: torch.dtype,
               trust_remote_code: bool) -> nn.Module:
    """from_pretrained, placement on the device, then the scheme's conversion; eval mode."""
    from transformers import AutoModelForCausalLM

    scheme = SCHEMES[scheme_name] if scheme_name else None
    kwargs = scheme.load_kwargs(dtype) if scheme and scheme.load_kwargs else {}
    if kwargs:
        kwargs["device_map"] = {"": device}  # bitsandbytes places while loading; .to() is refused afterwards
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(explain_load_failure(path, device, exc)) from exc
    if not kwargs:
        model = model.to(device)
    if scheme is not None and scheme.load_kwargs is None:
        model = CONVERTERS[(scheme.name, device.type)](model, device)
        log.info("quantized %s to %s on %s: %.1f MB of weights", path, scheme.name, device.type,
                 weight_bytes(model) / 1e6)
        if device.type == "cpu":
            own_parameters(model)
            warn_if_slow_at_working_batch(scheme.name, model)
    return model.eval()


def own_parameters(model: nn.Module) -> int:
    """Copy the parameters a quantization left as they were loaded (norm weights, biases) into memory of their own.
    from_pretrained maps a safetensors checkpoint and hands out views of the mapping where the dtype matches; one
    such view keeps the whole file mapped, and every page read while quantizing counts in the process's resident
    size: at the Qwen2.5-0.5B shape, 2.4 GB of float32 checkpoint for 0.64 GB of int8 weights. Returns how many."""
    copies: dict[int, nn.Parameter] = {}  # a parameter shared by two modules (tied weights) stays shared
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    if id(param) not in copies:
                        copies[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
                    module._parameters[name] = copies[id(param)]
    return len(copies)


def cpu_kind() -> str:
    """The CPU kind the working-batch figures are kept for: amx (bf16 and int8 matrix tiles), avx512_bf16 (native
    bf16 dot products), avx512, avx2, or other."""
    from batchgen.engines.hf.backends.cpu.runtime import cpu_flags, has_native_bf16

    flags = cpu_flags()
    if "amx_bf16" in flags and has_native_bf16():
        return "amx"
    if has_native_bf16():
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


def measured_as(scheme_name: str, model: Optional[nn.Module]) -> str:
    """The name a scheme's working-batch figure is kept under for what it built in `model`: int8 that fell back to
    weight-only is int8_wo, int4 in int8 is int4-w4a8, int4 without batchgen's kernels is int4-torchao; "" for the
    dynamic-int8 fallback (no figure is its own)."""
    if model is None:
        return scheme_name
    kinds = {type(m) for m in model.modules()}
    if scheme_name == "int4":
        return ("int4-w4a8" if Int4DynamicLinear in kinds else "int4" if Int4WeightOnlyLinear in kinds
                else "int4-torchao")
    if scheme_name == "int8" and Int8DynamicLinear not in kinds:
        scheme_name = "int8_wo"  # W8A8 does not run here: int8 fell back to weight-only
    if scheme_name == "int8_wo" and Int8WeightOnlyLinear not in kinds:
        return ""  # the dynamic-int8 fallback
    return scheme_name


def warn_if_slow_at_working_batch(scheme_name: str, model: Optional[nn.Module] = None) -> None:
    """Say so when what the scheme built here decoded large batches slower than the unquantized model on a CPU of
    this kind."""
    name, kind = measured_as(scheme_name, model), cpu_kind()
    ratio = CPU_WORKING_BATCH_VS_UNQUANTIZED.get(kind, {}).get(name)
    if ratio is None or ratio >= 0.9:
        return
    log.warning("%s on this CPU decodes large batches slower than the unquantized model: %.2fx its output tokens/s "
                "at batch 64 with engine.dtype=auto, measured on a CPU of this kind (%s; docs/performance.md); "
                "use it when the model does not fit in memory unquantized, or for batch-1 jobs, where it measured "
                "faster", name, ratio, kind)


def explain_load_failure(path: str, device: torch.device, exc: Exception) -> str:
    """Name a pre-quantized checkpoint's method when loading it fails (GPTQ/AWQ kernels are mostly CUDA-only)."""
    method = checkpoint_quant_method(path)
    if method is None:
        return f"loading {path} failed: {exc}"
    return (f"loading {path} failed: it is a pre-quantized {method} checkpoint and its kernels could not run on "
            f"{device.type} (many GPTQ/AWQ kernels need CUDA, and an extra package such as gptqmodel, autoawq "
            f"or compressed-tensors); leave engine.quantization null for such checkpoints. Cause: {exc}")


def checkpoint_quant_method(path: str) -> Optional[str]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
    qcfg = getattr(config, "quantization_config", None)
    if isinstance(qcfg, dict):
        return qcfg.get("quant_method")
    return getattr(qcfg, "quant_method", None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights as stored: parameters, buffers and quantized packed weights."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor_bytes(tensor)
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)  # torch.ao dynamic quantized Linear
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += tensor_bytes(weight) + (tensor_bytes(bias) if bias is not None else 0)
    return total


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage of a tensor; tensor subclasses (torchao) are counted by their inner tensors."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    if t.is_quantized:
        extra = 0
        if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            extra = t.q_per_channel_scales().nbytes + t.q_per_channel_zero_points().nbytes
        return t.numel() * t.element_size() + extra
    return t.numel() * t.element_size()


def device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type
