"""The hf engine's logits processors (engines/hf/sampling/processors.py) and min_p: token for token equal to HF
generate with the same processors (float32; greedy, and seeded sampling, HF's greedy search taking the draw's
token from its noise added last), on both decode paths; penalised greedy rows pick from their penalised logits, not
the step's argmax; min_tokens holds EOS and stop strings off; rows without processors keep their logits untouched."""

from __future__ import annotations

import pytest
import torch

from batchgen.engines.hf.sampling import processors
from batchgen.engines.hf.sampling.draw import RowParams, as_int64, filter_logits, gumbel, sample
from batchgen.engines.hf.sampling.sampler import Sampler
from batchgen.records import Request
from batchgen.sampling import SampleParams
from tests.conftest import corpus, generate_generic

EOS_BIAS = ((1, 0.3),)  # the stand-in model's EOS (id 1) made likely enough to end rows early, at different steps


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine

    return HFEngine(HFConfig(model=tiny_model, dtype="float32", max_batch_tokens=2048, max_batch_size=16), tokenizer)


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def params(**kw) -> SampleParams:
    base = dict(max_new_tokens=24, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False)
    return SampleParams(**(base | kw))


class CounterHashDraw:
    """HF's last logits processor: the draw's noise (draw.gumbel) for the row's seed and step added to the warped
    scores, so that HF's greedy search takes the token the draw takes."""

    def __init__(self, seed: int, prompt_len: int):
        self.seed, self.prompt_len = torch.tensor([as_int64(seed)]), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = torch.tensor([input_ids.shape[1] - self.prompt_len])
        return scores + gumbel(self.seed, step, scores.shape[-1])


def hf_generate(model, ids: list[int], n: int, seed=None, **kw) -> list[int]:
    """HF generate on one row alone; seeded: HF's processors, then its temperature and min-p warpers, then the draw's
    noise for the seed (top-k and top-p off), HF taking the largest."""
    if seed is not None:
        from transformers import LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper

        warpers = [TemperatureLogitsWarper(kw.pop("temperature"))]
        warpers += [MinPLogitsWarper(kw.pop("min_p"))] if "min_p" in kw else []
        kw["logits_processor"] = LogitsProcessorList([*warpers, CounterHashDraw(seed, len(ids))])
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=kw.pop("do_sample", False), **kw)
    return out[0, len(ids):].tolist()


def hf_keywords(p: SampleParams) -> dict:
    """SampleParams' processors as HF generate's keywords (logit_bias: sequence_bias of one-token sequences)."""
    kw = {"repetition_penalty": p.repetition_penalty, "min_new_tokens": p.min_tokens or None,
          "sequence_bias": {(t,): b for t, b in p.logit_bias} or None, "min_p": p.min_p or None}
    if not p.greedy:
        kw["temperature"] = p.temperature
    return {k: v for k, v in kw.items() if v is not None}


CASES = {"repetition": dict(repetition_penalty=1.3), "anti-repetition": dict(repetition_penalty=0.7),
         "bias": dict(logit_bias=((5, 3.0), (9, -100.0))),
         "min_tokens": dict(logit_bias=EOS_BIAS, min_tokens=4, repetition_penalty=1.2)}


@pytest.mark.parametrize("case", CASES)
def test_greedy_rows_equal_hf_generate_with_the_same_processors(engine, reference, tokenizer, case):
    """Six rows in one batch (they end at different steps under min_tokens), fast path and generic path alike."""
    p = params(**CASES[case])
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=p, seed=None)
            for i, t in enumerate(corpus(6, seed=11))]
    want = [hf_generate(reference, r.prompt_ids, 24, **hf_keywords(p)) for r in reqs]
    assert want != [hf_generate(reference, r.prompt_ids, 24) for r in reqs]  # the processors change the rows
    fast = engine.generate(reqs)
    generic = generate_generic(engine, reqs)
    for got in (fast, generic):
        assert [(r.text, r.num_generated_tokens) for r in got] == [
            (tokenizer.decode(w, skip_special_tokens=True), len(w)) for w in want]
    if case == "min_tokens":
        assert min(len(w) for w in want) == 5 and len({len(w) for w in want}) > 2


def test_seeded_samples_equal_hf_generate_with_the_same_processors(engine, reference, tokenizer):
    """Each row's draw after HF's processors and warpers: the same tokens (the noise a function of seed and step)."""
    p = params(max_new_tokens=16, temperature=0.8, repetition_penalty=1.3, min_p=0.05, logit_bias=EOS_BIAS,
               min_tokens=3)
    reqs = [Request(key=i, prompt_ids=tokenizer(t).input_ids, params=p, seed=100 + i)
            for i, t in enumerate(corpus(4, seed=11))]
    want = [hf_generate(reference, r.prompt_ids, 16, seed=r.seed, **hf_keywords(p)) for r in reqs]
    assert [r.text for r in engine.generate(reqs)] == [tokenizer.decode(w, skip_special_tokens=True) for w in want]


def test_min_p_draws_only_what_hf_and_the_device_sampler_keep():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 3
    p = params(temperature=0.7, min_p=0.1)
    x = logits / p.temperature
    kept = set(torch.isfinite(MinPLogitsWarper(0.1)(None, x.clone())[0]).nonzero().flatten().tolist())
    device = filter_logits(x.clone(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.1]))
    assert kept == set(torch.isfinite(device[0]).nonzero().flatten().tolist()) and 1 < len(kept) < 50
    drawn = sample(logits.expand(300, -1), RowParams.of_rows([p] * 300, [7] * 300, logits.device), torch.arange(300))
    assert set(drawn.tolist()) <= kept


def test_processors_match_their_definitions_and_leave_other_rows_alone():
    """logit_bias, min_tokens, repetition (HF's processor), presence and frequency (OpenAI's formula) on row 1, a
    logit bias alone on row 2 (past its min_tokens); row 0, unprocessed, keeps its values bit for bit."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    prompt, generated = [2, 3, 3], [3, 7, 7]
    p = params(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0),),
               min_tokens=5)
    biased = params(logit_bias=((0, -1.0), (11, 1.0)), min_tokens=2)
    histories = [processors.History.start(q, prompt, 12, logits.device) for q in (p, biased)]
    for token in generated:
        for history in histories:
            history.take(token)
    got = processors.apply(logits, [1, 2], [p, biased], histories, [len(generated)] * 2, [0])
    want = logits[1].clone()
    want[4] += 2.0
    want[0] = float("-inf")
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + generated]), want[None])[0]
    counts = torch.bincount(torch.tensor(generated), minlength=12).float()
    want = want - 0.25 * counts - 0.5 * (counts > 0)
    assert torch.equal(got[0], logits[0]) and torch.allclose(got[1], want)
    assert torch.equal(got[2], logits[2] + torch.tensor([-1.0] + [0.0] * 10 + [1.0]))


def test_a_penalised_greedy_row_picks_from_its_penalised_logits_not_the_steps_argmax(tokenizer):
    sampler = Sampler(tokenizer, {1}, torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0], [0.0, 0.0, 5.0, 4.0]])
    reqs = [Request(key=0, prompt_ids=[2], params=params(repetition_penalty=2.0), seed=None),
            Request(key=1, prompt_ids=[2], params=params(), seed=None)]
    draws = [sampler.start(r) for r in reqs]
    assert sampler.pick(logits, reqs, draws, picks=logits.argmax(dim=-1)) == [3, 2]


def test_min_tokens_holds_stop_strings_off_and_cuts_at_a_later_match(engine, tokenizer):
    """A stop string that the first min_tokens tokens complete does not count (vLLM's min_tokens); one completed
    after them cuts the text there."""
    ids = tokenizer("the river town").input_ids
    free = engine.generate([Request(key=0, prompt_ids=ids, params=params(max_new_tokens=40, ignore_eos=True),
                                    seed=None)])[0]
    stop = next(free.text[i:i + 3] for i in range(len(free.text) - 3) if free.text.count(free.text[i:i + 3]) > 1
                and free.text[i:i + 3].strip() == free.text[i:i + 3])
    first = free.text.find(stop)
    plain = engine.generate([Request(key=0, prompt_ids=ids, params=params(max_new_tokens=40, ignore_eos=True,
                                                                           stop=(stop,)), seed=None)])[0]
    held = engine.generate([Request(key=0, prompt_ids=ids, params=params(
        max_new_tokens=40, ignore_eos=True, stop=(stop,), min_tokens=plain.num_generated_tokens), seed=None)])[0]
    assert plain.text == free.text[:first] and plain.finish_reason == "stop"
    assert held.text == free.text[:free.text.find(stop, first + 1)] and held.finish_reason == "stop"
    assert held.num_generated_tokens > plain.num_generated_tokens


def free_run(engine, tokenizer, text: str = "the river town", n: int = 24):
    """A row's greedy generation with nothing set: the ids the knobs below change."""
    ids = tokenizer(text).input_ids
    got = engine.generate([Request(key=0, prompt_ids=ids, params=params(max_new_tokens=n, ignore_eos=True),
                                   seed=None)])[0]
    return ids, tokenizer(got.text, add_special_tokens=False).input_ids, got


def vllm_bad_words_ids(tokenizer, words) -> list[list[int]]:
    """vLLM 0.32's SamplingParams.update_from_tokenizer, written out: each word alone, and with a leading space where
    that is another first token of as many tokens."""
    out = []
    for w in words:
        alone = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        out += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    return out


def test_bad_words_allowed_and_stop_token_ids_equal_hf_generate(engine, reference, tokenizer):
    """vLLM's bad_words (HF's bad_words_ids of the words' tokens), allowed_token_ids (HF's prefix_allowed_tokens_fn)
    and stop_token_ids (HF's eos_token_id list: the token is kept, a special one dropped from the text), min_tokens
    holding a stop token off as it holds EOS: token for token HF generate's, on both decode paths."""
    ids, free, _ = free_run(engine, tokenizer)
    words = [tokenizer.decode([free[2]]).strip(), tokenizer.decode(free[5:7]).strip()]
    allowed = sorted(set(free) - {free[0]})
    stop = free[6]
    eos = tokenizer.eos_token_id
    cases = [(params(bad_words=tuple(words)), dict(bad_words_ids=vllm_bad_words_ids(tokenizer, words))),
             (params(allowed_token_ids=tuple(allowed)), dict(prefix_allowed_tokens_fn=lambda b, x: allowed)),
             (params(stop_token_ids=(stop,)), dict(eos_token_id=[eos, stop])),
             (params(stop_token_ids=(stop,), min_tokens=8), dict(eos_token_id=[eos, stop], min_new_tokens=8))]
    for p, keywords in cases:
        want = hf_generate(reference, ids, 24, **keywords)
        assert want != free[:len(want)] or len(want) < len(free)  # the knob changes the row
        reqs = [Request(key=0, prompt_ids=ids, params=p, seed=None)]
        for got in (engine.generate(reqs), generate_generic(engine, reqs)):
            assert (got[0].text, got[0].num_generated_tokens) == (tokenizer.decode(want, skip_special_tokens=True),
                                                                  len(want)), p
            assert got[0].finish_reason == ("stop" if want[-1] in (eos, stop) else "length")
    held = hf_generate(reference, ids, 24, eos_token_id=[eos, stop], min_new_tokens=8)
    assert stop not in held[:8]


def test_a_multi_token_bad_word_bans_its_last_token_only_after_the_others():
    """vLLM's rule: a word's last token is -inf where the generation ends with its other tokens, and only there."""
    h = processors.History.start(params(bad_words=("x",)), [4], 16, torch.device("cpu"), bad=((3, 7), (9,)))
    assert h.banned() == [9]
    h.take(3)
    assert h.banned() == [7, 9]
    h.take(2)
    assert h.banned() == [9]


def test_the_text_keeps_the_stop_string_and_the_special_tokens_where_asked(engine, tokenizer):
    """include_stop_str_in_output: the text is cut after the stop string, not before it; skip_special_tokens=false:
    the EOS the row ended on is in its text (as tokenizer.decode without skipping writes it)."""
    ids, _, free = free_run(engine, tokenizer)
    stop = free.text[6:9]
    first = free.text.find(stop)
    assert 0 < first + len(stop) < len(free.text)
    kept = engine.generate([Request(key=0, prompt_ids=ids, params=params(
        ignore_eos=True, stop=(stop,), include_stop_str_in_output=True), seed=None)])[0]
    assert kept.text == free.text[:first + len(stop)] and kept.finish_reason == "stop"
    ended = params(logit_bias=EOS_BIAS, max_new_tokens=40)
    plain = engine.generate([Request(key=0, prompt_ids=ids, params=ended, seed=None)])[0]
    raw = engine.generate([Request(key=0, prompt_ids=ids, params=params(
        logit_bias=EOS_BIAS, max_new_tokens=40, skip_special_tokens=False), seed=None)])[0]
    assert plain.finish_reason == raw.finish_reason == "stop"
    assert raw.text == tokenizer.decode(tokenizer(plain.text, add_special_tokens=False).input_ids
                                        + [tokenizer.eos_token_id]) and raw.text.endswith(tokenizer.eos_token)
