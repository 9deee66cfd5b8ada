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


def test_the_token_and_text_knobs_reach_vllms_sampling_params():
    """bad_words, allowed_token_ids, stop_token_ids, include_stop_str_in_output, skip_special_tokens and
    spaces_between_special_tokens: a real SamplingParams holds them (vLLM checks their types as it builds it), and
    off they are vLLM's defaults."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.vllm = import_vllm()
    engine.top_k_off = engine.vllm.SamplingParams().top_k
    params = SampleParams(max_new_tokens=16, temperature=0.0, top_p=1.0, top_k=0, stop=("x",), ignore_eos=False,
                          bad_words=("foo", "bar baz"), allowed_token_ids=(3, 5, 8), stop_token_ids=(7, 9),
                          include_stop_str_in_output=True, skip_special_tokens=False,
                          spaces_between_special_tokens=False)
    sp = engine.sampling_params(Request(key=0, prompt_ids=[1, 2], params=params, seed=None))
    assert (list(sp.bad_words), list(sp.allowed_token_ids), list(sp.stop_token_ids)) == (
        ["foo", "bar baz"], [3, 5, 8], [7, 9])
    assert (sp.include_stop_str_in_output, sp.skip_special_tokens, sp.spaces_between_special_tokens) == (
        True, False, False)
    off = engine.sampling_params(Request(key=0, prompt_ids=[1, 2], params=SampleParams(8, 0.0, 1.0, 0, (), False),
                                         seed=None))
    default = engine.vllm.SamplingParams()
    assert (off.bad_words, off.allowed_token_ids, off.stop_token_ids, off.include_stop_str_in_output,
            off.skip_special_tokens, off.spaces_between_special_tokens) == (
        default.bad_words, default.allowed_token_ids, default.stop_token_ids, default.include_stop_str_in_output,
        default.skip_special_tokens, default.spaces_between_special_tokens)


def test_every_sampling_params_field_has_batchgens_key_or_why_not():
    """The "Coming from vLLM" names (commands/keys.py VLLM_NAMES, listed in docs/recipes.md) cover every field a user
    sets on the installed vLLM's SamplingParams and every LLM.generate argument."""
    import inspect

    from batchgen.commands.keys import VLLM_NAMES

    vllm = import_vllm()
    fields = [f for f in vllm.SamplingParams.__struct_fields__ if not f.startswith("_")]
    arguments = [a for a in inspect.signature(vllm.LLM.generate).parameters if a != "self"]
    assert [name for name in fields + arguments if name not in VLLM_NAMES] == []
