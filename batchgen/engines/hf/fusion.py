"""Fused projections: each decoder layer's q/k/v projections merged into one GEMM, and gate/up into another, with
FusedSlice views standing where the parts were. Knows the model's layer modules; how a fused module is built is
the caller's `fuse` (a oneDNN-prepacked linear, a quantized one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn


def fuse_projections(model: Any, fuse: Callable[[list[nn.Module]], Optional[nn.Module]]) -> int:
    """Merge each layer's q/k/v projections into `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj`;
    returns how many fused modules were made. `fuse(parts)` builds one module computing the parts' outputs
    concatenated (e.g. a oneDNN-prepacked linear over the concatenated weights), or None to leave them.

    One GEMM over the concatenated weights reads the input once and pays one call instead of three (two): with
    oneDNN-prepacked weights on the development CPU, the projections of a decode step ran 13-22% faster. The
    parts are replaced layer by layer (the model is never held twice); their names become FusedSlice views,
    so the model's own forward (hf.py's generic path) still computes the same thing.
    """
    made = 0
    for layer in model.model.layers:
        for owner, names, fused_name in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                         (layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
            parts = [getattr(owner, name, None) for name in names]
            if any(p is None for p in parts) or len({getattr(p, "in_features", None) for p in parts}) != 1:
                continue
            fused = fuse(parts)
            if fused is None:
                continue
            setattr(owner, fused_name, fused)
            start = 0
            for name, part in zip(names, parts):
                setattr(owner, name, FusedSlice(fused, start, start + part.out_features))
                start += part.out_features
            made += 1
    return made


def concatenate_linears(parts: list[nn.Module]) -> Optional[nn.Linear]:
    """`fuse` for plain linears on any device: one nn.Linear whose output is the parts' outputs side by side (same
    input size); None where a part is not a plain nn.Linear."""
    if not all(type(p) is nn.Linear for p in parts):
        return None
    weight = torch.cat([p.weight.detach() for p in parts])
    biased = any(p.bias is not None for p in parts)
    linear = nn.Linear(parts[0].in_features, weight.shape[0], bias=biased, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if biased:
        linear.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else
                                              weight.new_zeros(p.out_features) for p in parts]), requires_grad=False)
    return linear


class FusedSlice(nn.Module):
    """Output features [start, stop) of a fused projection, standing where the model's own projection was.

    Only the model's own forward calls it (it computes the whole fused GEMM to keep a slice); the stepper calls
    the fused module once instead. The fused module is held outside the module tree: it is registered once,
    on its owner, so walking the model meets it once.
    """

    def __init__(self, fused: nn.Module, start: int, stop: int):
        super().__init__()
        self._fused = (fused,)
        self.start, self.stop = start, stop
        self.in_features, self.out_features = getattr(fused, "in_features", None), stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0](x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"features [{self.start}, {self.stop}) of a fused projection"
