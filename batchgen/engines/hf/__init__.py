"""The hf engine: torch + transformers, on CPU or GPU, one file per concern.

- engine.py: loading and routing (HFEngine, what the registry builds);
- device.py: device and dtype (engine.dtype=auto), batch defaults per device;
- sampler.py: token choice, finish reasons, results;
- scheduler.py: continuous batching over the slot cache; kvcache.py: that cache; step.py: the Llama-family
  prefill and decode step that runs on it;
- generic.py: any other architecture, static buckets over a DynamicCache;
- quant/: engine.quantization, by scheme (the registry, int8, int4);
- cpu/: the CPU fast path: batchgen's C kernels and their loader, the oneDNN linears, the dtype
  calibration, the process's CPU runtime settings (flags, malloc).

Nothing outside engines/ imports these modules; the job reaches the engine through engines.build_engine.
"""
