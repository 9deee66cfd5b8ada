"""engine=vllm's logits processors reach vLLM: the engine's own sampling_params() builds a real vLLM SamplingParams
holding a sample's repetition, presence and frequency penalties, min_p, min_tokens and logit_bias (vLLM checks the
names and ranges as it builds it). No vLLM start-up: only the request's parameters are built."""

from __future__ import annotations

import pytest

from batchgen.engines.vllm import VLLMEngine, import_vllm
from batchgen.records import Request
from batchgen.sampling import SampleParams

pytestmark = pytest.mark.vllm


def test_the_logits_processors_reach_vllms_sampling_params():
    engine = VLLMEngine.__new__(VLLMEngine)  # its sampling_params() needs vllm and top_k_off, not a loaded model
    engine.vllm = import_vllm()
    engine.top_k_off = engine.vllm.SamplingParams().top_k
    params = SampleParams(max_new_tokens=16, temperature=0.7, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                          repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.25, min_p=0.05,
                          min_tokens=4, logit_bias=((1, -100.0), (5, 2.5)))
    sp = engine.sampling_params(Request(key=0, prompt_ids=[1, 2], params=params, seed=3))
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens) == (
        1.3, 0.5, -0.25, 0.05, 4)
    assert {int(k): float(v) for k, v in sp.logit_bias.items()} == {1: -100.0, 5: 2.5}
    off = engine.sampling_params(Request(key=0, prompt_ids=[1, 2], params=SampleParams(8, 0.0, 1.0, 0, (), False),
                                         seed=None))
    default = engine.vllm.SamplingParams()
    assert (off.repetition_penalty, off.presence_penalty, off.frequency_penalty, off.min_p, off.min_tokens) == (
        default.repetition_penalty, default.presence_penalty, default.frequency_penalty, default.min_p,
        default.min_tokens)
    assert not off.logit_bias
