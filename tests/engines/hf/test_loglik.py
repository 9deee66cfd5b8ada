"""task=loglik: each row's log-likelihood equals an unbatched Hugging Face forward's within 1e-4 (float32), on rows of
mixed lengths, with a text scored given a prompt and a prompt scored alone; rows longer than engine.max_model_len
are scored in windows (every token once, with at least half a window of context); bad rows cost their row; a
resumed job writes what an uninterrupted one did; what loglik cannot take is refused."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.engine import HFEngine
from batchgen.engines.hf.loglik import LoglikScorer
from batchgen.errors import ConfigError
from batchgen.records import Request
from batchgen.run.runner import run_job
from batchgen.sampling import SampleParams
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_jsonl


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, from one unbatched forward."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return [logp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def windowed(model, ids: list[int], first: int, width: int) -> float:
    """The documented windows, written independently: token t >= width is scored in the window starting at the
    multiple of width // 2 that puts it in that window's second half."""
    half = width // 2
    total = 0.0
    for t in range(first, len(ids)):
        start = 0 if t < width else ((t - width) // half + 1) * half
        total += token_logprobs(model, ids[start:t + 1])[-1]
    return total


def rows(n: int = 14) -> list[dict]:
    rng = random.Random(5)
    texts = corpus(n, seed=6)
    return [{"id": f"r{i:02d}", "prompt": " ".join(corpus(1, seed=100 + i)[0].split()[:rng.randint(1, 12)]),
             "text": texts[i]} for i in range(n)]


def run(model: str, data, out, *extra: str) -> dict[str, dict]:
    run_job(compose_job(job_overrides(model, data, out, "task=loglik", "dataset.id_column=id", *extra)))
    return {r["id"]: r for r in read_output(out).to_pylist()}


def test_a_texts_loglik_given_its_prompt_equals_an_unbatched_forward(tiny_model, hf, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = write_jsonl(tmp_path / "in.jsonl", rows())
    got = run(tiny_model, data, tmp_path / "out", "dataset.text_column=text", "run.rows_per_part=5")
    for r in rows():
        prompt = tok(r["prompt"])["input_ids"]
        ids = prompt + tok(r["text"], add_special_tokens=False)["input_ids"]
        want = sum(token_logprobs(hf, ids)[len(prompt) - 1:])
        row = got[r["id"]]
        assert row["loglik"] == pytest.approx(want, abs=1e-4) and row["scored_tokens"] == len(ids) - len(prompt)
        assert row["loglik_mean"] == pytest.approx(want / row["scored_tokens"], abs=1e-6)
        assert row["perplexity"] == pytest.approx(math.exp(-row["loglik_mean"]), rel=1e-9)
        assert row["generation"] is None and row["finish_reason"] == "scored" and row["error"] is None


def test_a_prompt_scored_alone_and_rows_longer_than_the_window(tiny_model, hf, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    long_rows = [{"id": f"l{i}", "prompt": " ".join(corpus(6, seed=40 + i))} for i in range(4)]  # 60 to 120 tokens
    data = write_jsonl(tmp_path / "in.jsonl", long_rows)
    got = run(tiny_model, data, tmp_path / "out", "engine.max_model_len=24")
    whole = run(tiny_model, data, tmp_path / "whole")
    for r in long_rows:
        ids = tok(r["prompt"])["input_ids"]
        assert len(ids) > 48
        assert got[r["id"]]["loglik"] == pytest.approx(windowed(hf, ids, 1, 24), abs=1e-4)
        assert got[r["id"]]["scored_tokens"] == whole[r["id"]]["scored_tokens"] == len(ids) - 1
        assert whole[r["id"]]["loglik"] == pytest.approx(sum(token_logprobs(hf, ids)), abs=1e-4)


def test_bad_rows_cost_their_row_and_a_resumed_job_writes_the_same(tiny_model, tmp_path):
    data = rows(12)
    data[2]["text"], data[7]["text"], data[9]["prompt"] = "", 42, ""
    path = write_jsonl(tmp_path / "in.jsonl", data)
    args = ("dataset.text_column=text", "run.rows_per_part=4")
    first = run(tiny_model, path, tmp_path / "out", *args)
    assert first["r02"]["error"] == "empty_text" and first["r07"]["error"].startswith("non_string_text")
    assert first["r09"]["error"] == "empty_prompt" and first["r00"]["error"] is None
    for name in ("part-00001.parquet", "_SUCCESS"):
        (tmp_path / "out" / name).unlink()
    again = run(tiny_model, path, tmp_path / "out", *args)
    assert again == first


def test_the_model_forward_path_scores_what_the_fast_path_scores(tiny_model, tmp_path):
    """Architectures outside the Llama family score through the model's own forward: the same values."""
    from batchgen.engines import build_engine
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = compose_job(job_overrides(tiny_model, write_jsonl(tmp_path / "x.jsonl", rows(1)), tmp_path / "o"))
    engine = build_engine(cfg.engine, tok)
    params = SampleParams(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                          score_from=3)
    reqs = [Request(key=k, prompt_ids=tok(t)["input_ids"], params=params, seed=None)
            for k, t in enumerate(corpus(6, seed=9))]
    fast = engine.generate(reqs)
    engine.fast, engine._loglik = False, None
    slow = engine.generate(reqs)
    assert [r.loglik[0] for r in slow] == pytest.approx([r.loglik[0] for r in fast], abs=1e-4)
    assert [r.loglik[1] for r in slow] == [r.loglik[1] for r in fast]


def test_what_loglik_cannot_take_is_refused(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", rows(2))
    with pytest.raises(ConfigError) as err:
        run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "a", "task=loglik", "sampling.n=2",
                                          "sampling.logprobs=2", "engine=vllm")))
    problems = str(err.value)
    assert "task=loglik runs on engine=hf (got engine=vllm)" in problems
    assert "sampling.n: task=loglik generates nothing" in problems and "sampling.logprobs" in problems
    with pytest.raises(ConfigError, match="dataset.text_column is the text task=loglik scores"):
        run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "b", "dataset.text_column=text")))


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("last", False)])
def test_an_embedding_equals_an_unbatched_forwards_pooled_hidden_state(tiny_model, hf, tmp_path, pooling, normalize):
    """task=embed: the rendered prompt's final hidden states (after the model's last norm) pooled, within 1e-4."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = write_jsonl(tmp_path / "in.jsonl", rows(10))
    got = run(tiny_model, data, tmp_path / "out", "task=embed", f"embed.pooling={pooling}",
              f"embed.normalize={str(normalize).lower()}", "run.rows_per_part=4")
    for r in rows(10):
        ids = tok(r["prompt"])["input_ids"]
        with torch.no_grad():
            states = hf.model(torch.tensor([ids])).last_hidden_state[0].double()
        want = states.mean(dim=0) if pooling == "mean" else states[-1]
        if normalize:
            want = want / want.norm()
        row = got[r["id"]]
        assert row["embedding"] == pytest.approx(want.tolist(), abs=1e-4)
        assert row["finish_reason"] == "scored" and row["generation"] is None and "loglik" not in row
    with pytest.raises(ConfigError, match="embed.pooling must be one of mean, last"):
        run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "x", "task=embed", "embed.pooling=max")))


@pytest.mark.parametrize("task", [("task=loglik", "dataset.text_column=text"), ("task=embed",)],
                         ids=["loglik", "embed"])
def test_a_scoring_job_killed_after_journaling_resumes_to_the_same_rows(tiny_model, tmp_path, task):
    """SIGKILL right after the first scores are journaled (a part half done), then the same command: every row once,
    equal to an uninterrupted run's, the journaled scores reused. A loglik rescored after the resume sits in another
    prefill group (longest first, within engine.max_batch_tokens), and float32 GEMMs sum by their batch's shape: its
    value equals within float32 rounding (seen: 7e-9 relative), not bit for bit (docs/engines.md says so); the
    embeddings, pooled per row, came out equal here, and are held to the same bound."""
    from tests.conftest import run_cli

    data = write_jsonl(tmp_path / "in.jsonl", rows(10))
    cli = job_overrides(tiny_model, data, tmp_path / "out", *task, "dataset.id_column=id", "run.rows_per_part=4",
                        "engine.dtype=float32")
    killed = run_cli(cli, env={"BATCHGEN_TEST_KILL_AT": "samples journaled"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    resumed = run_cli(cli)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reused from part journals" in resumed.stdout + resumed.stderr
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "clean", *task, "dataset.id_column=id",
                                      "run.rows_per_part=4", "engine.dtype=float32")))
    got, want = read_output(tmp_path / "out").to_pylist(), read_output(tmp_path / "clean").to_pylist()
    assert [r["id"] for r in got] == [r["id"] for r in rows(10)]
    floats = ("loglik", "loglik_mean", "perplexity", "embedding")
    for g, w in zip(got, want):
        assert {k: v for k, v in g.items() if k not in floats} == {k: v for k, v in w.items() if k not in floats}
        for k in floats:
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-6), (g["id"], k)


DECIDE = ((" Is it a bug?", (" yes", " no")), (" Team:", (" web", " mobile", " payments", " infra")))


def scoring_requests(tokenizer) -> list[Request]:
    """Rows of mixed lengths (4 to ~120 tokens) as task=loglik, task=embed and task=decide requests (each row's
    prompt shared by its 6 answers to two questions, as the planner plans them), keyed so that any order maps back."""
    texts = [" ".join(t.split()[:n]) for t, n in zip(corpus(9, seed=21), (2, 30, 9, 60, 4, 18, 45, 12, 90))]
    greedy = dict(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False)
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer(text).input_ids
        out.append(Request(key=f"loglik{i}", prompt_ids=ids, params=SampleParams(**greedy, score_from=1), seed=None))
        out.append(Request(key=f"embed{i}", prompt_ids=ids, params=SampleParams(**greedy, pooling="mean"),
                           seed=None))
        asks = [(ids + tokenizer(q, add_special_tokens=False).input_ids,
                 tokenizer(a, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
                for q, answers in DECIDE for a in answers]
        every = tuple(tuple(question[len(ids) - 1:] + answer) for question, answer in asks)
        for j, (question, answer) in enumerate(asks):
            params = SampleParams(**greedy, score_from=len(question), shared=len(ids) - 1, answers=every)
            out.append(Request(key=f"decide{i}:{j}", prompt_ids=question + answer, params=params, seed=None))
    return out


def score_in(scorer: LoglikScorer, groups: list[list[Request]]) -> dict[str, tuple]:
    """Each request's scores, bit for bit, scored in `groups` (each group one call per kind, as with_loglik calls)."""
    out = {}
    for group in groups:
        for kind in ("loglik", "embed", "decide"):
            todo = [r for r in group if r.key.startswith(kind)]
            for r, result in zip(todo, scorer.score(todo) if todo else []):
                out[r.key] = tuple(result.embedding or result.loglik)
    return out


@pytest.mark.parametrize("path", ["step", "model forward"])
def test_a_rows_scores_are_the_same_bits_in_any_batch_whatever_threads_a_governor_left(tiny_model, tokenizer, path):
    """task=loglik, task=embed and task=decide: a row scored alone, with every other row in shuffled order, in
    threes: the same bits (a resumed job prefills its remaining rows in other groups). A decide row asked for only
    some of its answers (each alone; all but the first two, as a resume after two were journaled) scores them as its
    whole set did: the row's set is prefilled together whatever part of it is asked. The engine is configured for
    one thread and torch was left at two (a thread governor's count for decode steps): scoring runs on one, whose sums
    differ from two's for some rows here, so a scorer that ran on what it was left with fails too. One thread keeps
    the test to seconds on a shared machine."""
    engine = HFEngine(HFConfig(model=tiny_model, dtype="float32"), tokenizer)
    scorer = engine.loglik_scorer()
    if path == "model forward":
        scorer = LoglikScorer(engine.model, None, engine.device, max_len=engine.max_model_len,
                              max_batch_tokens=engine.max_batch_tokens)
    scorer.threads = 1
    requests = scoring_requests(tokenizer)
    shuffled = random.Random(3).sample(requests, len(requests))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = score_in(scorer, [requests])
        assert len(whole) == len(requests)
        torch.set_num_threads(2)  # what a governor left: scoring runs on scorer.threads
        resumed = [r for r in requests if not r.key.startswith("decide") or int(r.key.split(":")[1]) >= 2]
        for groups in ([[r] for r in requests], [shuffled], [shuffled[i:i + 3] for i in range(0, len(shuffled), 3)],
                       [resumed]):
            got = score_in(scorer, groups)
            assert [k for k in got if got[k] != whole[k]] == [], len(groups)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
