"""oneDNN weight prepacking for the linear layers of a model on CPU.

A plain `nn.Linear` on CPU calls MKL with the weight as stored. Reordering the weight once into
oneDNN's blocked layout makes the small-batch GEMMs of a decode step markedly faster on this kind of
machine (measured in benchmarks/throughput.py; vLLM's CPU build does the same through its own
oneDNN binding). The reorder replaces each weight, one layer at a time, so the model is never held
twice. Knows modules and tensors, not requests or schedules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines.hf.backends.cpu.runtime import CheckpointPages
from batchgen.engines.hf.fusion import concatenate_linears

log = logging.getLogger(__name__)
BATCH_HINT = 32  # the M oneDNN tunes the blocked layout for; any M runs on it
# Smaller weights stay nn.Linear: oneDNN's per-call overhead outweighs its faster kernel there (measured on the
# test suite's tiny model, hidden size 64: the engine ran 20% slower with every linear prepacked).
MIN_FEATURES = 256


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-blocked weight; the same result up to float rounding. An input of another
    dtype than the weight's (float32 activations around bf16 GEMMs, see mixed_bf16) is cast to the weight's dtype
    and the output back to the input's."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        bias: Optional[torch.Tensor] = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.packed.dtype:
            x2 = x2.to(self.packed.dtype)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def available(dtype: torch.dtype) -> bool:
    """True where this torch build can reorder and run a linear weight through oneDNN in `dtype`."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = nn.Linear(16, 8, bias=True, dtype=dtype)
        x = torch.randn(3, 16, dtype=dtype)
        return torch.allclose(PackedLinear(probe)(x).float(), F.linear(x, probe.weight, probe.bias).float(),
                              rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.info("oneDNN weight prepacking unavailable (%s); linears stay as they are", exc)
        return False


def replace_linears(model: nn.Module, convert: Callable[[nn.Linear], Optional[nn.Module]]) -> tuple[int, int]:
    """Swap each plain `nn.Linear` for `convert(linear)` in place (None keeps it); returns (replaced, kept).

    Each original weight is dropped as soon as its replacement exists, and its pages of a mapped checkpoint
    given back (runtime.CheckpointPages), so a conversion holds one extra layer at a time, never a second copy
    of the model.
    """
    replaced = kept = 0
    pages = CheckpointPages()  # the checkpoint's pages of each dropped weight are given back as it goes
    held: dict[int, int] = {}  # how many modules hold each parameter (tied weights: more than one)
    for _, param in model.named_parameters(remove_duplicate=False):
        held[id(param)] = held.get(id(param), 0) + 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            new = convert(child)
            if new is None:
                kept += 1
                continue
            setattr(parent, name, new)
            kept_by_new = any(tensor is child.weight for tensor in (*new.parameters(), *new.buffers()))
            if not kept_by_new and held.get(id(child.weight), 0) == 1:
                pages.release(child.weight)
            child.weight = None
            replaced += 1
    return replaced, kept


def pack_linears(model: Any) -> int:
    """Replace every plain `nn.Linear` of a CPU model by a PackedLinear, in place; returns how many.

    An LM head that shares its weight with the input embeddings is left alone: packing it would
    keep a second copy of the largest matrix of the model. So are weights with a side under
    MIN_FEATURES, where oneDNN's call overhead costs more than its kernel saves.
    """
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    shared = None if embed is None else embed.weight.data_ptr()
    return replace_linears(model, lambda linear: None if linear.weight.data_ptr() == shared else pack(linear))[0]


def pack(linear: nn.Linear) -> Optional[PackedLinear]:
    """`linear` reordered for oneDNN, or None where it should stay as it is (not on CPU, or too small)."""
    if linear.weight.device.type != "cpu" or min(linear.in_features, linear.out_features) < MIN_FEATURES:
        return None
    return PackedLinear(linear)


class CastLinear(nn.Module):
    """A linear computed in its own weight's dtype inside a model whose activations are another dtype: the input
    goes in as the weight's dtype, the output comes back in the input's (torchao's int4 CPU kernel takes bf16
    activations only; mixed_bf16 keeps small or shared linears in bf16 this way)."""

    def __init__(self, linear: nn.Module, dtype: torch.dtype):
        super().__init__()
        if type(linear) is nn.Linear:  # a shell over the same parameters: replace_linears empties the original
            shell = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            shell.weight, shell.bias = linear.weight, linear.bias
            linear = shell
        self.linear, self.dtype = linear, dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(self.dtype)).to(x.dtype)


class CastEmbedding(nn.Module):
    """An embedding table kept in its stored dtype (bf16: half the bytes) whose lookups come out in `dtype`."""

    def __init__(self, embedding: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.embedding, self.dtype = embedding, dtype
        self.weight = embedding.weight  # what transformers' tied-weight and resize helpers look at

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids).to(self.dtype)


def mixed_bf16(model: Any, fuse: Optional[Callable[[Any, Callable], int]] = None) -> tuple[int, int]:
    """Turn a CPU model loaded in bfloat16 into bf16 GEMMs with float32 between them, in place: every linear
    becomes a oneDNN-prepacked bf16 PackedLinear (or a CastLinear where prepacking does not pay or would copy a
    shared weight), the input embeddings stay bf16 and hand float32 on, and every other weight (norms) becomes
    float32. The decode step then runs batchgen's float32 kernels between native bf16 GEMMs (as vLLM's CPU build
    keeps its own kernels around oneDNN's). `fuse(model, fuse_parts)` merges projections first (step.py's
    fuse_projections). Returns (linears prepacked, projections fused). Nothing is held twice: weights are
    converted one module at a time, and the bf16 weights are the only copy."""
    fused = fuse(model, pack_concatenated) if fuse is not None else 0
    embed = model.get_input_embeddings()
    shared = None if embed is None else embed.weight.data_ptr()

    def convert(linear: nn.Linear) -> nn.Module:
        packed = None if linear.weight.data_ptr() == shared else pack(linear)
        return packed if packed is not None else CastLinear(linear, linear.weight.dtype)

    replace_linears(model, convert)
    casts = [m for m in model.modules() if isinstance(m, CastLinear)]
    kept_bf16 = {id(sub) for cast in casts for sub in cast.modules()}  # a CastLinear and its shell stay bf16
    for module in model.modules():
        if id(module) in kept_bf16 or module is embed or isinstance(module, PackedLinear):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.bfloat16:
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
    if isinstance(embed, nn.Embedding):
        model.set_input_embeddings(CastEmbedding(embed, torch.float32))
    return sum(isinstance(m, PackedLinear) for m in model.modules()), fused


def pack_concatenated(parts: list[nn.Module]) -> Optional[PackedLinear]:
    """`fuse` for fusion.fuse_projections: the parts' concatenated weights, prepacked; None where not."""
    linear = concatenate_linears(parts)
    return None if linear is None else pack(linear)
