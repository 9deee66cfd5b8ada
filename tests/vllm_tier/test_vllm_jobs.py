"""engine=vllm against a real vLLM (the CPU build here): a job end to end, a SIGKILL mid-job and resume,
greedy equivalence with the hf engine, and chat-template rendering identical to the hf engine's.

Four vLLM start-ups in all: a clean sampled run, a run killed mid-job and its resume (these three eager,
through engine.extra_args), and a greedy chat run on vLLM's default compiled path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from batchgen.output.journal import read_journal
from batchgen.run.runner import run_job
from batchgen.sampling import derive_seed
from tests.conftest import REPO, WORDS, compose_job, corpus, job_overrides, read_output, run_cli, write_parquet

pytestmark = pytest.mark.vllm

ROWS = 48  # sampled job: 12 parts of 4 rows, 2 samples each
EAGER = "+engine.extra_args.enforce_eager=true"  # passed through to vllm.LLM: no torch.compile, ~40 s less start-up
SAMPLED = ("engine=vllm", EAGER, "dataset.id_column=uid", "run.rows_per_part=4", "sampling=sample", "sampling.n=2",
           "sampling.max_new_tokens=24", "sampling.ignore_eos=true", "sampling.seed=7")
CHAT = ("dataset.messages_column=messages", "dataset.id_column=uid", "sampling.max_new_tokens=32",
        "sampling.stop=[green]", "run.rows_per_part=16")  # the stand-in model often says "green": some rows stop


def sampled_rows() -> list[dict]:
    rows = [{"uid": f"row-{i}", "prompt": t, "topic": i % 3} for i, t in enumerate(corpus(ROWS, seed=11))]
    rows[5]["prompt"] = ""  # a bad row: recorded as an error, the job goes on
    return rows


def chat_rows() -> list[dict]:
    """Conversations of 1 to 6 messages (some with a system message): prompts of about 30 to 200 tokens."""
    texts = corpus(120, seed=12)
    rows = []
    for i in range(24):
        turns = 1 + 2 * (i % 3)
        roles = ["user", "assistant"] * 3
        messages = [{"role": roles[t], "content": " ".join(texts[(i * 5 + t) % 120].split()[: 2 + 3 * i])}
                    for t in range(turns)]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "answer in " + WORDS[i % len(WORDS)] + " words"})
        rows.append({"uid": f"c{i}", "messages": messages})
    return rows


def run_vllm(args: list[str]) -> subprocess.CompletedProcess:
    proc = run_cli(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def sampled_data(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("sampled") / "in.parquet", sampled_rows())


@pytest.fixture(scope="module")
def clean_run(vllm_model, sampled_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    started = time.perf_counter()
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # vLLM's defaults: batchgen sizes the KV cache
    proc = run_vllm(job_overrides(vllm_model, sampled_data, out, *SAMPLED))
    print(f"clean vllm run: {time.perf_counter() - started:.1f}s")
    (out.parent / "log.txt").write_text(proc.stdout + proc.stderr)  # Hydra's console log goes to stdout
    return out


def test_vllm_on_cpu_starts_with_its_defaults_and_a_kv_cache_batchgen_sized(clean_run):
    """The engine's INFO line is in the run's log file (the console shows warnings, the bar and the summary)."""
    log = "".join(p.read_text() for p in clean_run.glob("_logs/*/batchgen.log"))
    assert "vllm on cpu: KV cache" in log, log[-3000:]


def test_job_end_to_end(clean_run, vllm_model, sampled_data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_model)
    rows = sampled_rows()
    got = read_output(clean_run).to_pylist()
    assert (clean_run / "_SUCCESS").exists()
    assert len(list(clean_run.glob("part-*.parquet"))) == ROWS // 4
    assert [(r["id"], r["sample_index"]) for r in got] == [(x["uid"], s) for x in rows for s in range(2)]
    for r, src in zip(got, [x for x in rows for _ in range(2)]):
        assert r["seed"] == derive_seed(7, r["id"], r["sample_index"]) and r["topic"] == src["topic"]
        if src["prompt"] == "":
            assert (r["finish_reason"], r["error"], r["generation"]) == ("error", "empty_prompt", None)
            continue
        assert r["error"] is None and r["finish_reason"] == "length" and r["num_generated_tokens"] == 24
        assert r["num_prompt_tokens"] == len(tok(src["prompt"]).input_ids)
    samples = [(got[i]["generation"], got[i + 1]["generation"]) for i in range(0, len(got), 2)]
    assert sum(a != b for a, b in samples) >= ROWS - 2, "the two samples of a row must use their own seeds"
    manifest = json.loads((clean_run / "_manifest.json").read_text())
    assert manifest["config"]["engine"]["name"] == "vllm"
    status = json.loads((clean_run / "_status.json").read_text())
    assert status["state"] == "done" and status["rows_done"] == ROWS and status["rows_failed"] == 1


def test_sigkill_mid_job_then_resume_equals_the_clean_run(clean_run, vllm_model, sampled_data, tmp_path):
    """kill -9 of the whole process group (batchgen and vLLM's engine process) after the first commit."""
    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "batchgen", *job_overrides(vllm_model, sampled_data, killed, *SAMPLED)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(killed / "part-00000.parquet", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    parts_at_kill = len(list(killed.glob("part-*.parquet")))
    assert not (killed / "_SUCCESS").exists() and 1 <= parts_at_kill < ROWS // 4
    run_vllm(job_overrides(vllm_model, sampled_data, killed, *SAMPLED))
    got, want = read_output(killed), read_output(clean_run)
    keys = list(zip(got.column("id").to_pylist(), got.column("sample_index").to_pylist()))
    assert len(set(keys)) == len(keys) == 2 * ROWS  # every id exactly once per sample
    assert got.equals(want), "a resumed run must sample exactly what an uninterrupted run samples"
    print(f"killed with {parts_at_kill} of {ROWS // 4} parts committed; resumed output identical to the clean run")


def wait_for(path, proc, timeout=420.0):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def chat_runs(vllm_model, tmp_path_factory):
    """The same greedy chat job on both engines, in float32."""
    base = tmp_path_factory.mktemp("chat")
    data = write_parquet(base / "in.parquet", chat_rows())
    started = time.perf_counter()
    run_vllm(job_overrides(vllm_model, data, base / "vllm", "engine=vllm", *CHAT))
    print(f"greedy chat vllm run: {time.perf_counter() - started:.1f}s")
    run_job(compose_job(job_overrides(vllm_model, data, base / "hf", *CHAT)))
    return read_output(base / "vllm").to_pylist(), read_output(base / "hf").to_pylist()


def test_chat_rendering_is_identical_to_the_hf_engine(chat_runs, vllm_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_model)
    vllm_rows, hf_rows = chat_runs
    assert [r["id"] for r in vllm_rows] == [r["id"] for r in hf_rows] == [r["uid"] for r in chat_rows()]
    for v, h, src in zip(vllm_rows, hf_rows, chat_rows()):
        ids = tok.apply_chat_template(src["messages"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert v["num_prompt_tokens"] == h["num_prompt_tokens"] == len(ids), v["id"]
        assert v["error"] is None and h["error"] is None
    # token for token: the ids both engines are given are the planner's, from the same rendering; compare them
    # with the tokenizer's own chat template tokenization
    from batchgen.prompts.planner import Planner
    from batchgen.prompts.render import Renderer
    from batchgen.reader import open_reader

    data = write_parquet(tmp_path / "in.parquet", chat_rows())
    cfg = compose_job(job_overrides(vllm_model, data, tmp_path / "unused", *CHAT))
    planner = Planner(cfg, open_reader(cfg.dataset), Renderer(cfg.dataset, tok), tok)
    planned = [planner.plan(part, 4096) for part in planner.parts(skip=set())]
    given = [req.prompt_ids for p in planned for req in p.requests]
    assert len(given) == len(chat_rows())
    for src, ids_given in zip(chat_rows(), given):
        want = tok.apply_chat_template(src["messages"], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ids_given == list(want), src["uid"]


def test_greedy_float32_equals_the_hf_engine_token_for_token(chat_runs):
    vllm_rows, hf_rows = chat_runs
    same = [v["id"] for v, h in zip(vllm_rows, hf_rows) if _sample(v) == _sample(h)]
    stopped = sum(h["finish_reason"] == "stop" for h in hf_rows)
    print(f"greedy agreement with the hf engine: {len(same)}/{len(hf_rows)} rows identical ({stopped} stopped on "
          f"the stop string)")
    assert 0 < stopped < len(hf_rows), "the stop string should end some rows and not others"
    for v, h in zip(vllm_rows, hf_rows):
        assert _sample(v) == _sample(h), (v["id"], v["generation"], h["generation"])


def _sample(row: dict) -> tuple:
    return row["generation"], row["finish_reason"], row["num_generated_tokens"]


def test_sigkill_inside_a_part_keeps_what_vllm_had_finished(vllm_model, sampled_data, tmp_path):
    """One part of all rows, decoded 8 requests at a time: requests are journaled as vLLM finishes them,
    so a kill mid-part keeps those, and the resumed run completes the part without redoing them."""
    out = tmp_path / "one-part"
    overrides = [o for o in SAMPLED if not o.startswith("run.rows_per_part=")]
    overrides += [f"run.rows_per_part={ROWS}", "engine.max_batch_size=8"]
    args = [sys.executable, "-m", "batchgen", *job_overrides(vllm_model, sampled_data, out, *overrides)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    journal = out / "_part-00000.journal"
    try:
        deadline = time.time() + 420
        while not (journal.exists() and len(read_journal(journal)[1]) >= 8):
            assert proc.poll() is None, proc.stderr.read()[-4000:]
            assert time.time() < deadline, "timed out waiting for journaled requests"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _, kept, _ = read_journal(journal)
    assert not (out / "part-00000.parquet").exists() and 8 <= len(kept) < 2 * ROWS
    resumed = run_vllm(job_overrides(vllm_model, sampled_data, out, *overrides))
    assert f"skipped, {len(kept)} samples reused from part journals" in resumed.stdout, resumed.stdout[-2000:]
    got = read_output(out)
    keys = list(zip(got.column("id").to_pylist(), got.column("sample_index").to_pylist()))
    assert len(set(keys)) == len(keys) == 2 * ROWS
    rows = got.to_pylist()  # one part of all rows: a sample's key is its position in the output
    assert all(rows[r.key]["generation"] == r.text for r in kept)  # reused as vLLM first wrote them
    print(f"killed with {len(kept)} of {2 * ROWS} samples journaled inside the only part; the resume reused all "
          f"of them and completed the part")


def test_constrained_rows_on_vllm_all_parse_and_validate(vllm_model, tmp_path):
    """One vLLM start-up, the three constraints side by side in one window (StructuredOutputsParams per request): every
    row stops and passes batchgen's own check, with the bounded schema, the regex and the choices."""
    import jsonschema
    from transformers import AutoTokenizer

    from batchgen.constraints import Constraint, check
    from batchgen.engines import build_engine
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    ticket = {"type": "object", "properties": {"label": {"enum": ["billing", "bug", "other"]},
                                               "urgent": {"type": "boolean"}},
              "required": ["label", "urgent"], "additionalProperties": False}
    kinds = [Constraint("json_schema", json.dumps(ticket, sort_keys=True)),
             Constraint("regex", r"[a-z]{2,6}-[0-9]{2}"), Constraint("choice", json.dumps(["yes", "no", "not sure"]))]
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": "x"}])
    cfg = compose_job(job_overrides(vllm_model, data, tmp_path / "out", "engine=vllm", EAGER))
    tok = AutoTokenizer.from_pretrained(vllm_model)
    engine = build_engine(cfg.engine, tok)
    try:
        prompts = [tok(p)["input_ids"] for p in corpus(12, seed=21)]
        reqs = [Request(key=k, prompt_ids=ids, seed=None, params=SampleParams(
            max_new_tokens=48, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
            constraint=kinds[k % 3])) for k, ids in enumerate(prompts)]
        free = [Request(key=100 + k, prompt_ids=ids, seed=None, params=SampleParams(
            max_new_tokens=8, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True, logprobs=2))
            for k, ids in enumerate(prompts[:4])]  # sampling.logprobs on vLLM: the same columns as the hf engine
        results = engine.generate(reqs + free)
        results, logged = results[:len(reqs)], results[len(reqs):]
    finally:
        engine.close()
    for req, res in zip(reqs, results):
        parsed, error = check(req.params.constraint, res.text, res.finish_reason)
        assert res.finish_reason == "stop" and error is None, (req.params.constraint.kind, res.text, error)
        if req.params.constraint.kind == "json_schema":
            jsonschema.validate(json.loads(parsed), ticket)
            assert "\n" not in res.text
    for res in logged:
        assert len(res.token_logprobs) == len(res.top_logprobs) == res.num_generated_tokens == 8
        for picked, top in zip(res.token_logprobs, res.top_logprobs):
            assert len(top) == 2 and top[0][2] >= top[1][2] and picked == pytest.approx(top[0][2], abs=1e-5)
            assert top[0][1] == tok.decode([top[0][0]])


def test_beam_search_on_vllm_gives_n_ranked_beams_per_row(vllm_model, tmp_path):
    """sampling.num_beams through vLLM's LLM.beam_search: n samples per row, ranked; vLLM's own search (its top 2 *
    beam_width tokens per beam) is not transformers', so agreement with the hf engine is reported, not required."""
    data = write_parquet(tmp_path / "in.parquet", [{"uid": f"b{i}", "prompt": t} for i, t in enumerate(corpus(8))])
    beams = ("dataset.id_column=uid", "sampling.num_beams=4", "sampling.n=2", "sampling.max_new_tokens=10",
             "run.rows_per_part=4")
    run_vllm(job_overrides(vllm_model, data, tmp_path / "vllm", "engine=vllm", EAGER, *beams))
    run_job(compose_job(job_overrides(vllm_model, data, tmp_path / "hf", *beams)))
    v, h = read_output(tmp_path / "vllm").to_pylist(), read_output(tmp_path / "hf").to_pylist()
    assert [(r["id"], r["sample_index"]) for r in v] == [(f"b{i}", s) for i in range(8) for s in range(2)]
    assert all(r["error"] is None and r["finish_reason"] in ("stop", "length") and 0 < r["num_generated_tokens"] <= 10
               for r in v)
    assert any(a["generation"] != b["generation"] for a, b in zip(v[0::2], v[1::2]))  # distinct beams
    same = sum(a["generation"] == b["generation"] for a, b in zip(v, h))
    print(f"beam search: vLLM and the hf engine agree on {same} of {len(v)} samples")
