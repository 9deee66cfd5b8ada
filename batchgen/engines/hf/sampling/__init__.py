"""Choosing each row's next token in the hf engine: the Sampler's policy (greedy, temperature, top-k/top-p/min-p,
seeded draws, finishing), the one draw every device runs (draw.py), the per-row logits processors (penalties, logit
bias, min_tokens) and the grammar matchers of constrained decoding."""
