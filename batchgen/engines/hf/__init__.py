"""The hf engine: torch + transformers, on CPU or GPU, one file per concern.

- engine.py: loading and routing (HFEngine, what the registry builds);
- device.py: device and dtype (engine.dtype=auto), batch defaults per device;
- sampling/: token choice (sampler.py: finish reasons, results; processors.py; grammar.py);
- scheduler.py: continuous batching over the slot cache (pool.py: the rows waiting and live; oom.py: the
  out-of-memory back-off); kvcache.py: that cache; prefix.py: shared prompt prefixes; step.py: the reference
  Llama-family prefill and decode step that runs on it;
- backends/: each device's plan and stepper (cpu/: batchgen's C kernels, oneDNN, calibration, runtime; cuda/:
  the graph-captured decode, the Triton decode and varlen prefill attention, the device sampler);
- generic.py: any other architecture, static buckets over a DynamicCache;
- loglik.py, score.py, beam.py: task=loglik/embed, choice scores, beam search;
- quant/: engine.quantization, by scheme.

Nothing outside engines/ imports these modules; the job reaches the engine through engines.build_engine.
"""
