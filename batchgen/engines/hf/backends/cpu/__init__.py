"""The hf engine's CPU fast path: the C kernels (kernels_*.c over kernels_simd.h) and their loader kernels.py
(compiled per ISA on first use), onednn.py (prepacked oneDNN linears, bf16 GEMMs with float32 kernels between
them), calibration.py (engine.dtype=auto on CPU, by measurement) and runtime.py (CPU flags, malloc settings)."""
