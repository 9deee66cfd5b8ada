"""Choosing each row's next token in the hf engine: the Sampler's policy (greedy, temperature, top-k/top-p/min-p,
seeded draws, finishing), the per-row logits processors (penalties, logit bias, min_tokens) and the grammar
matchers of constrained decoding. The CUDA backend's device sampler (backends/cuda/sampling.py) follows this policy."""
