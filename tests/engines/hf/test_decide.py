"""task=decide: every question's probabilities equal those of unbatched Hugging Face forwards (each answer's " answer"
then EOS scored after the row's prompt and the question's, softmax over the question's answers) within 1e-4
(float32); answers that are prefixes of each other ("bug", "bugfix") scored apart; a predicate's yes and no summing
to 1; a score's expected level; the needs_review column; the row's prompt prefilled once for all its questions; a
resumed job writing what an uninterrupted one did; bad question sets refused."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchgen.errors import ConfigError
from batchgen.run.runner import run_job
from tests.conftest import compose_job, corpus, job_overrides, read_output, write_jsonl

QUESTIONS = ('+decide.questions=[{name: bug, kind: predicate, prompt: " Is it a bug?", abstain_below: 0.9}, '
             '{name: topic, kind: choice, prompt: " Topic:", options: [bug, bugfix, billing]}, '
             '{name: urgency, kind: score, prompt: " Urgency from 1 to 4:", levels: 4}]')
ANSWERS = {"bug": ("predicate", " Is it a bug?", ["yes", "no"]),
           "topic": ("choice", " Topic:", ["bug", "bugfix", "billing"]),
           "urgency": ("score", " Urgency from 1 to 4:", ["1", "2", "3", "4"])}


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def loglik(model, ids: list[int], first: int) -> float:
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return sum(logp[t - 1, ids[t]].item() for t in range(first, len(ids)))


def expected(model, tok, prompt: str, question: str, answers: list[str]) -> list[float]:
    base = tok(prompt)["input_ids"] + tok(question, add_special_tokens=False)["input_ids"]
    scores = [loglik(model, base + tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                     len(base)) for a in answers]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    return [w / sum(weights) for w in weights]


def rows(n: int = 8) -> list[dict]:
    return [{"id": f"t{i}", "prompt": p} for i, p in enumerate(corpus(n, seed=12))]


def decide(model: str, data, out, *extra: str) -> dict[str, dict]:
    run_job(compose_job(job_overrides(model, data, out, "task=decide", "dataset.id_column=id", QUESTIONS, *extra)))
    return {r["id"]: r for r in read_output(out).to_pylist()}


def test_every_questions_probabilities_equal_unbatched_forwards(tiny_model, hf, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = write_jsonl(tmp_path / "in.jsonl", rows())
    got = decide(tiny_model, data, tmp_path / "out", "run.rows_per_part=3")
    for r in rows():
        row = got[r["id"]]
        assert row["finish_reason"] == "scored" and row["generation"] is None and row["error"] is None
        review = False
        for name, (kind, question, answers) in ANSWERS.items():
            want = expected(hf, tok, r["prompt"], question, answers)
            d = row[name]
            assert [p["answer"] for p in d["probabilities"]] == answers
            assert [p["p"] for p in d["probabilities"]] == pytest.approx(want, abs=1e-4)
            assert sum(p["p"] for p in d["probabilities"]) == pytest.approx(1.0, abs=1e-9)
            best = max(range(len(answers)), key=lambda i: want[i])
            assert d["answer"] == answers[best] and d["confidence"] == pytest.approx(want[best], abs=1e-4)
            if kind == "score":
                assert d["expected"] == pytest.approx(sum((i + 1) * p for i, p in enumerate(want)), abs=1e-3)
            else:
                assert d["expected"] is None
            review = review or (name == "bug" and d["confidence"] < 0.9)
        assert row["needs_review"] is review


def test_a_rows_prompt_is_prefilled_once_for_all_its_questions(tiny_model, tmp_path):
    """Nine scored sequences (3 questions, 2 + 3 + 4 answers) of one row: the prompt once, then each sequence's
    own tokens only; and the same values as scoring each sequence whole."""
    from batchgen.engines import build_engine
    from batchgen.prompts.planner import Planner
    from batchgen.prompts.render import Renderer
    from batchgen.reader import open_reader

    tok = AutoTokenizer.from_pretrained(tiny_model)
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    cfg = compose_job(job_overrides(tiny_model, data, tmp_path / "o", "task=decide", QUESTIONS))
    planner = Planner(cfg, open_reader(cfg.dataset), Renderer(cfg.dataset, tok), tok)
    planned = planner.plan(next(planner.parts(set())), 2048)
    engine = build_engine(cfg.engine, tok)
    shared = engine.generate(planned.requests)
    prefix = planned.requests[0].params.shared
    own = sum(len(r.prompt_ids) - prefix for r in planned.requests)
    assert len(planned.requests) == 9 and engine._loglik.tokens == prefix + own
    engine._loglik.stepper, engine._loglik.tokens = None, 0  # each sequence whole, through the model's forward
    whole = engine.generate(planned.requests)
    assert engine._loglik.tokens == sum(len(r.prompt_ids) for r in planned.requests) > 3 * (prefix + own) // 2
    assert [r.loglik[0] for r in shared] == pytest.approx([r.loglik[0] for r in whole], abs=1e-4)


def test_a_resumed_decide_job_writes_the_same_and_bad_rows_cost_their_row(tiny_model, tmp_path):
    data = rows(9)
    data[4]["prompt"] = ""
    path = write_jsonl(tmp_path / "in.jsonl", data)
    first = decide(tiny_model, path, tmp_path / "out", "run.rows_per_part=3")
    assert first["t4"]["error"] == "empty_prompt" and first["t4"]["bug"] is None
    for name in ("part-00001.parquet", "_SUCCESS"):
        (tmp_path / "out" / name).unlink()
    assert decide(tiny_model, path, tmp_path / "out", "run.rows_per_part=3") == first


def test_bad_question_sets_are_refused_naming_the_question(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", rows(1))
    with pytest.raises(ConfigError, match="task=decide asks decide.questions"):
        run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "a", "task=decide")))
    bad = ('+decide.questions=[{name: x, kind: choice, options: [a]}, {name: x, kind: vote}, '
           '{name: s, kind: score, levels: 1, abstain_below: 2}]')
    with pytest.raises(ConfigError) as err:
        run_job(compose_job(job_overrides(tiny_model, data, tmp_path / "b", "task=decide", bad)))
    text = str(err.value)
    assert "decide.questions[0].options: a choice needs at least two distinct options" in text
    assert "decide.questions[1].name must be a unique identifier" in text
    assert "decide.questions[1].kind must be one of predicate, choice, score" in text
    assert "decide.questions[2].levels must be in 2..100" in text and "decide.questions[2].abstain_below" in text


def test_the_decide_preset_and_its_output_read_back_in_pandas_and_duckdb(tiny_model, tmp_path):
    """`batchgen job=decide` (the support tickets, three questions; the tiny model in place of the demo model) and
    the docs' read-back in pandas and duckdb (docs/engines.md)."""
    import duckdb
    import pandas as pd

    from tests.conftest import run_cli

    out = tmp_path / "decide"
    done = run_cli(["job=decide", f"output_dir={out}", f"engine.model={tiny_model}", "dataset.limit=12",
                    "run.progress=false", "engine.dtype=float32"])
    assert done.returncode == 0, done.stderr
    df = pd.read_parquet(out)
    assert len(df) == 12 and set(df["topic"].str["answer"]) <= {"billing", "bug", "feature", "account", "other"}
    rows = duckdb.sql(f"select id, is_bug.answer, is_bug.confidence, topic.answer, urgency.expected, "
                      f"needs_review from '{out}/*.parquet' order by urgency.expected desc limit 10").fetchall()
    assert len(rows) == 10 and all(1.0 <= r[4] <= 5.0 and r[1] in ("yes", "no") for r in rows)


def test_a_decide_job_killed_after_journaling_resumes_to_the_same_rows(tiny_model, tmp_path):
    """SIGKILL right after the first scores are journaled (a part half done), then the same command: the rows equal
    an uninterrupted run's, the journaled scores reused."""
    from tests.conftest import run_cli

    data = write_jsonl(tmp_path / "in.jsonl", rows(10))
    cli = [*job_overrides(tiny_model, data, tmp_path / "out", "task=decide", "dataset.id_column=id", QUESTIONS,
                          "run.rows_per_part=4")]
    killed = run_cli(cli, env={"BATCHGEN_TEST_KILL_AT": "samples journaled"})
    assert killed.returncode == -9, killed.stderr
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    resumed = run_cli(cli)
    assert resumed.returncode == 0, resumed.stderr
    assert "reused from part journals" in resumed.stdout + resumed.stderr
    clean = decide(tiny_model, data, tmp_path / "clean", "run.rows_per_part=4")
    assert {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()} == clean


def test_rows_needing_review_are_counted_in_the_summary_the_history_and_the_report(tiny_model, tmp_path):
    from batchgen.commands.report import _summary_rows, gather

    data = write_jsonl(tmp_path / "in.jsonl", rows(8))
    out = tmp_path / "out"
    strict = QUESTIONS.replace("abstain_below: 0.9", "abstain_below: 0.99999")
    summary = run_job(compose_job(job_overrides(tiny_model, data, out, "task=decide", "dataset.id_column=id",
                                                strict, "run.rows_per_part=3")))
    flagged = sum(r["needs_review"] for r in read_output(out).to_pylist())
    assert flagged > 0 and summary.totals.needs_review == flagged
    assert f"needs review: {flagged} rows" in summary.render()
    assert ["rows needing review (history; task=decide)", flagged] in _summary_rows(gather(out))
