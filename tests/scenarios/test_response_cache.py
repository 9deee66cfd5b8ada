"""Never paying twice: identical requests of a job are generated once (run.dedupe), answers are reused across nights
from run.cache_dir even where the ids changed, an unseeded-like change (another seed) is not reused, a corrupt cache
entry costs a miss, and none of it changes a row. Counted by the server's own request log (tests/endpoint_server.py:
a real model behind an OpenAI-compatible server)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_jsonl
from tests.engines.endpoint.test_engine_openai import endpoint

ROWS = 30


def night(prefix: str, seed: int = 8) -> list[dict]:
    """30 rows over 21 distinct texts (30% of the rows repeat another's text), ids with the night's prefix."""
    texts = corpus(21, seed=seed)
    rng = random.Random(seed)
    picks = texts + [rng.choice(texts) for _ in range(ROWS - len(texts))]
    rng.shuffle(picks)
    return [{"id": f"{prefix}-{i:02d}", "prompt": t} for i, t in enumerate(picks)]


def args(model: str, url: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["name=t", f"output_dir={out}", f"dataset.path={data}", "dataset.format=auto", "dataset.id_column=id",
            "run.progress=false", "engine=openai", "engine.model=tiny", f"engine.tokenizer={model}",
            f"engine.base_url={url}", "sampling.max_new_tokens=8", "run.rows_per_part=8", *extra]


def answered(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def generations(out: Path) -> dict[str, str]:
    return {r["id"]: r["generation"] for r in read_output(out).to_pylist()}


def by_text(rows: list[dict], gens: dict[str, str]) -> dict[str, str]:
    return {r["prompt"]: gens[r["id"]] for r in rows}


def test_each_distinct_request_is_generated_once_and_a_later_night_with_new_ids_sends_none(tiny_model, tmp_path):
    first, second = night("mon"), night("tue")
    data1, data2 = write_jsonl(tmp_path / "mon.jsonl", first), write_jsonl(tmp_path / "tue.jsonl", second)
    cache, log = tmp_path / "cache", tmp_path / "server.jsonl"
    with endpoint(tiny_model, log=log) as url:
        run_job(compose_job(args(tiny_model, url, data1, tmp_path / "plain", "run.dedupe=false")))
        plain = len(answered(log))
        summary = run_job(compose_job(args(tiny_model, url, data1, tmp_path / "mon", f"run.cache_dir={cache}")))
        monday = len(answered(log)) - plain
        tuesday_summary = run_job(compose_job(args(tiny_model, url, data2, tmp_path / "tue",
                                                   f"run.cache_dir={cache}")))
        tuesday = len(answered(log)) - plain - monday
    assert plain == ROWS and monday == len({r["prompt"] for r in first}) == 21 and tuesday == 0
    assert summary.cache.deduplicated == 9 and summary.cache.stored == 21
    assert tuesday_summary.cache.hits == ROWS and "30 samples from run.cache_dir" in tuesday_summary.render()
    assert generations(tmp_path / "mon") == generations(tmp_path / "plain")  # each row under its own id
    assert by_text(second, generations(tmp_path / "tue")) == by_text(first, generations(tmp_path / "plain"))


def test_a_corrupt_cache_entry_is_a_miss_and_other_seeds_are_not_reused(tiny_model, tmp_path):
    rows = night("wed")
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cache, log = tmp_path / "cache", tmp_path / "server.jsonl"
    sampled = ("sampling.temperature=0.9", "sampling.seed=3")
    with endpoint(tiny_model, log=log) as url:
        run_job(compose_job(args(tiny_model, url, data, tmp_path / "a", f"run.cache_dir={cache}", *sampled)))
        before = len(answered(log))
        entries = sorted(cache.rglob("*.json"))
        entries[0].write_text(entries[0].read_text()[:-20])  # torn
        entries[1].write_text(entries[1].read_text().replace('"text": "', '"text": "edited '))  # digest fails
        run_job(compose_job(args(tiny_model, url, data, tmp_path / "b", f"run.cache_dir={cache}", *sampled)))
        again = len(answered(log)) - before
        run_job(compose_job(args(tiny_model, url, data, tmp_path / "c", f"run.cache_dir={cache}",
                                 "sampling.temperature=0.9", "sampling.seed=4")))
        other_seed = len(answered(log)) - before - again
    assert before == ROWS  # sampled rows: each row's seed is its own (job seed, id), so no two rows share a request
    assert again == 2 and generations(tmp_path / "b") == generations(tmp_path / "a")
    assert other_seed == ROWS


def test_a_cache_on_object_storage(tiny_model, s3, tmp_path):
    """run.cache_dir on S3 (moto's local server, as the S3 tests use): the second job sends nothing."""
    rows = night("fri")
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    log = tmp_path / "server.jsonl"
    with endpoint(tiny_model, log=log) as url:
        run_job(compose_job(args(tiny_model, url, data, tmp_path / "a", "run.cache_dir=s3://bucket/cache")))
        first = len(answered(log))
        again = run_job(compose_job(args(tiny_model, url, data, tmp_path / "b", "run.cache_dir=s3://bucket/cache")))
    assert first == 21 and len(answered(log)) == first and again.cache.hits == ROWS
    assert generations(tmp_path / "b") == generations(tmp_path / "a")


def test_dedupe_on_the_hf_engine_writes_what_generating_every_row_writes(tiny_model, tmp_path):
    rows = night("thu")
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    on = run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "on", "dataset.id_column=id",
                                           "sampling.max_new_tokens=8")))
    run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "off", "dataset.id_column=id",
                                      "sampling.max_new_tokens=8", "run.dedupe=false")))
    assert on.cache.deduplicated == 9
    assert generations(tmp_path / "on") == generations(tmp_path / "off")


def test_scores_come_back_from_the_cache_whole(tiny_model, tmp_path):
    """task=loglik and task=embed answers are kept with their scores: a second job reads every row from run.cache_dir
    and writes what the first did."""
    data = write_jsonl(tmp_path / "in.jsonl", night("sat"))
    for task in ("loglik", "embed"):
        cache = tmp_path / f"cache-{task}"
        outs = [tmp_path / f"{task}-{i}" for i in range(2)]
        summaries = [run_job(compose_job(job_overrides(tiny_model, data, out, f"task={task}", "dataset.id_column=id",
                                                       f"run.cache_dir={cache}"))) for out in outs]
        assert summaries[0].cache.deduplicated == 9 and summaries[1].cache.hits == ROWS
        first, second = (sorted(read_output(out).to_pylist(), key=lambda r: r["id"]) for out in outs)
        assert second == first and all(r["finish_reason"] == "scored" for r in first)


def test_the_sampling_keys_added_later_leave_an_existing_caches_keys_as_they_were():
    """The logits processors' keys (repetition_penalty, the penalties, min_p, min_tokens, logit_bias, vLLM's token
    lists), the decoding keys (vLLM's text switches) and task=decide's answer set at their defaults: a request's key
    is the one batchgen computed before those keys existed (a cache filled then still answers); set, they count."""
    import dataclasses
    import hashlib
    import json

    from batchgen.records import Request
    from batchgen.run.respcache import request_key
    from batchgen.sampling import DECODING, PROCESSORS, SampleParams

    params = SampleParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=0, stop=("x",), ignore_eos=False)
    req = Request(key=0, prompt_ids=[5, 6, 7], params=params, seed=42)
    later = PROCESSORS.keys() | DECODING.keys() | {"answers"}  # answers: task=decide's row answer set
    before = {k: v for k, v in dataclasses.asdict(params).items() if k not in later}
    body = {"prompt": req.prompt_ids, "messages": req.messages, "seed": req.seed, "params": before}
    assert request_key("s", req) == hashlib.sha256(("s" + json.dumps(body, sort_keys=True, default=str)).encode()
                                                   ).hexdigest()
    penalised = dataclasses.replace(req, params=dataclasses.replace(params, repetition_penalty=1.2))
    assert request_key("s", penalised) != request_key("s", req)
    kept = dataclasses.replace(req, params=dataclasses.replace(params, include_stop_str_in_output=True))
    assert request_key("s", kept) != request_key("s", req)
    decided = dataclasses.replace(req, params=dataclasses.replace(params, answers=((7,), (8,))))
    assert request_key("s", decided) != request_key("s", req)
