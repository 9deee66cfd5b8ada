"""The hf engine's device seam: one backend per device kind, chosen once when the engine loads (`for_device`).

A backend prepares the loaded model for its device (prepack, fuse, quantize-side packing) and builds the stepper
that prefills and decodes on the slot KV cache. The scheduler, the cache's contract (kvcache.SlotKVCache) and the
sampler's policy stay device-free; step.LlamaStepper is the plain torch reference every backend is tested against.
"""
