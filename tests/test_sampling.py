"""sampling.py: the logits processors' keys (repetition, presence and frequency penalties, min_p, min_tokens,
logit_bias) from the command line into SampleParams, every bad value reported at once naming its key, the keys that
cannot go together refused, and the stop-string cut that min_tokens moves."""

from __future__ import annotations

import pytest

from batchgen.errors import ConfigError
from batchgen.sampling import PROCESSORS, SampleParams, SamplingConfig, find_stop, processor_value
from tests.conftest import compose_job, job_overrides, write_jsonl

SET = ("sampling.repetition_penalty=1.2", "sampling.presence_penalty=0.5", "sampling.frequency_penalty=-0.5",
       "sampling.min_p=0.05", "sampling.min_tokens=3", "sampling.logit_bias={7: -100, 3: 2.5}")


def test_the_keys_compose_from_the_command_line_into_sample_params(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b"}])
    cfg = compose_job(job_overrides(tiny_model, data, tmp_path / "out", *SET))
    assert cfg.sampling.processors() == {"repetition_penalty": 1.2, "presence_penalty": 0.5,
                                         "frequency_penalty": -0.5, "min_p": 0.05, "min_tokens": 3,
                                         "logit_bias": ((3, 2.5), (7, -100.0)), "bad_words": (),
                                         "allowed_token_ids": (), "stop_token_ids": ()}
    params = SampleParams(max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                          **cfg.sampling.processors())
    assert params.shapes_logits and not SampleParams(8, 0.0, 1.0, 0, (), False).shapes_logits
    assert SamplingConfig().processors() == PROCESSORS  # every one off by default


def test_every_bad_value_is_reported_at_once_naming_its_key():
    bad = SamplingConfig(repetition_penalty=0.0, presence_penalty=3.0, frequency_penalty=-2.5, min_p=1.5,
                         min_tokens=-1, logit_bias={-4: 1.0})
    problems = bad.problems()
    for key in ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "logit_bias"):
        assert sum(p.startswith(f"sampling.{key} ") for p in problems) == 1, (key, problems)
    assert SamplingConfig(max_new_tokens=4, min_tokens=5).problems() == [
        "sampling.min_tokens=5 must be <= sampling.max_new_tokens (4)"]
    assert processor_value("logit_bias", {"5": 101})[1] == "gives token 5 the bias 101, not a number in [-100, 100]"
    assert processor_value("logit_bias", {"12": -1}) == (((12, -1.0),), None)  # JSON's string keys
    assert processor_value("min_tokens", 2.0) == (2, None)  # pandas' float for an int column with a null


def test_keys_that_cannot_go_together_are_refused(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b", "rf": None}])
    with pytest.raises(ConfigError) as err:
        compose_job(job_overrides(tiny_model, data, tmp_path / "a", "sampling.num_beams=2",
                                  "sampling.repetition_penalty=1.1"))
    assert "sampling.num_beams > 1 cannot go with sampling.repetition_penalty" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose_job(job_overrides(tiny_model, data, tmp_path / "b", "sampling.min_tokens=2",
                                  "sampling.choice=[yes,no]"))
    assert "sampling.min_tokens cannot go with a sampling constraint" in str(err.value)
    with pytest.raises(ConfigError) as err:
        compose_job(job_overrides(tiny_model, data, tmp_path / "c", "engine=openai", "engine.model=m", "engine.base_url=http://127.0.0.1:9/v1",
                                  f"engine.tokenizer={tiny_model}", "engine.extensions=none", "sampling.min_p=0.1",
                                  "dataset.min_tokens_column=rf", "sampling.presence_penalty=0.5"))
    assert "sampling.min_p: not an OpenAI API setting" in str(err.value)
    assert "dataset.min_tokens_column: not an OpenAI API setting" in str(err.value)
    assert "presence_penalty" not in str(err.value)  # the OpenAI API's own


def test_a_stop_string_within_the_first_min_tokens_does_not_count():
    assert find_stop("ab.cd.ef", (".",)) == 2
    assert find_stop("ab.cd.ef", (".",), after=3) == 5  # ends at 3, inside the held text: the next one
    assert find_stop("ab.cd.ef", ("b.c",), after=3) == 1  # ends past it: counts, where it starts
    assert find_stop("ab.cd.ef", (".",), after=6) == -1


def test_vllms_token_and_text_knobs_are_checked_naming_their_keys(tiny_model, tmp_path):
    """bad values of sampling.stop_token_ids, allowed_token_ids, bad_words, the text's switches and
    truncate_prompt_tokens are each reported at once by key; prompt_logprobs is refused as not supported yet;
    allowed_token_ids with a constraint, and the token knobs under beam search, are refused."""
    bad = SamplingConfig(stop_token_ids=[-1], allowed_token_ids=["x"], bad_words=[""], skip_special_tokens="no",
                         truncate_prompt_tokens=0, prompt_logprobs=1)
    problems = bad.problems()
    for key in ("stop_token_ids", "allowed_token_ids", "bad_words", "skip_special_tokens", "truncate_prompt_tokens",
                "prompt_logprobs"):
        assert sum(p.startswith(f"sampling.{key}") for p in problems) == 1, (key, problems)
    assert "vLLM's -1, the model's length, is run.too_long=truncate_left" in " ".join(problems)
    assert SamplingConfig(allowed_token_ids=[3], choice=["a", "b"]).problems() == [
        "sampling.allowed_token_ids cannot go with a constraint: the constraint chooses the tokens"]
    assert SamplingConfig(stop_token_ids=["12", 3, 12]).processors()["stop_token_ids"] == (3, 12)
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a b"}])
    with pytest.raises(ConfigError) as err:
        compose_job(job_overrides(tiny_model, data, tmp_path / "a", "sampling.num_beams=2",
                                  "sampling.bad_words=[x]", "sampling.stop_token_ids=[3]"))
    assert "sampling.num_beams > 1 cannot go with sampling.bad_words, sampling.stop_token_ids" in str(err.value)
