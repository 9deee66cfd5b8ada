"""A host-sync guard for tests: inside `no_host_sync()`, an op that reads a tensor's value on the host or whose
output shape depends on tensor values raises AssertionError naming the op.

Either kind breaks a decode step captured as a CUDA graph (a sync stalls the host on the device; a value-dependent
shape cannot be captured), and both run silently on CPU tensors, so CPU tests catch them here instead. Built on
TorchDispatchMode (every aten op, as autograd and Python indexing lower them) plus a TorchFunctionMode for the two
Tensor methods that read values without an aten op (tolist, numpy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops that sync the host or have an output shape set by tensor values, whatever their arguments: why each is flagged
SYNC, SHAPE = "reads a value on the host", "has a value-dependent output shape"
FLAGGED = {
    "_local_scalar_dense": SYNC,  # .item(), int(t), float(t), bool(t), `if t:`
    "equal": SYNC,  # returns a Python bool
    "is_nonzero": SYNC,
    "nonzero": SHAPE,
    "argwhere": SHAPE,
    "masked_select": SHAPE,
    "unique": SHAPE,
    "unique_dim": SHAPE,
    "unique_consecutive": SHAPE,
    "_unique": SHAPE,
    "_unique2": SHAPE,
    "bincount": SHAPE,  # its length is the largest value + 1
    "histogram": SHAPE,
    "multinomial": "draws from generator state (a captured step would replay the same draws)",
}
VALUE_METHODS = {"tolist", "numpy"}  # Tensor methods reading values on the host without an aten op
BOOL = (torch.bool, torch.uint8)


class HostSyncError(AssertionError):
    """An op that syncs the host or has a value-dependent shape ran inside no_host_sync()."""


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in BOOL for i in indices or ())


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy from a device tensor to a CPU one: the host waits for the device."""
    name = func.overloadpacket.__name__
    if name == "_to_copy":
        src, device = args[0], kwargs.get("device")
        return src.device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def why_flagged(func: Any, args: tuple, kwargs: dict) -> str:
    """Why this aten call breaks a captured step, or "" when it does not."""
    name = func.overloadpacket.__name__
    if name in FLAGGED:
        return FLAGGED[name]
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args[1]):
        return "indexes with a boolean mask (a value-dependent shape: it lowers to nonzero)"
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size (its length is the repeats' sum)"
    if _to_host(func, args, kwargs):
        return "copies a device tensor to the host"
    if name == "lift_fresh" and args[0].numel() > 1:  # a Python scalar (x[i] = 0.0) is a constant: fine
        return "builds a tensor from a Python list (torch.tensor(list): a captured step would replay its values)"
    return ""


class _DispatchGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = why_flagged(func, args, kwargs)
        if reason:
            raise HostSyncError(f"{func} {reason}")
        return func(*args, **kwargs)


class _MethodGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in VALUE_METHODS:
            raise HostSyncError(f"Tensor.{func.__name__} reads tensor values on the host")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Raise HostSyncError (an AssertionError) at the first op in the block that syncs the host or has a
    value-dependent output shape. Not inside torch.inference_mode: a TorchDispatchMode does not see the ops on
    inference tensors there (the guard would pass anything); use torch.no_grad for the block and its inputs."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("no_host_sync() sees no op inside torch.inference_mode(): use torch.no_grad() instead")
    with _MethodGuard(), _DispatchGuard():
        yield
