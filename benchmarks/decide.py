"""task=decide with five questions against five separate choice_scores jobs on the same rows, same run.

    python benchmarks/decide.py                 # the benchmark model, 64 rows
    python benchmarks/decide.py --rows 128 --repeats 3

Workload (seeded): `--rows` prompts of a shared instruction (about 60 tokens) and a ticket of lognormal length
(median about 80 tokens); five questions of 2 to 5 answers. "decide": one job, task=decide, the five questions.
"choice_scores": five jobs, one per question, each with the question appended to the prompt (dataset.template) and
sampling.choice set to its answers with sampling.choice_scores=true (the hf engine's forced scoring of each choice,
its prefix cache sharing the prompt across the choices). Both on the hf engine with its defaults (engine.dtype=auto),
the engine loaded per job as a user would run them; the figures are the jobs' generation times (wall time less
start-up and model load) and, apart, the wall times. Alternating (decide, then the five jobs) per repeat; the ratio
is the five jobs' time over decide's, per repeat and as the median. Printed beside the figures: the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
QUESTIONS = [("kind", " Kind of ticket:", ["bug", "billing", "feature"]),
             ("team", " Team:", ["web", "mobile", "payments", "infra"]),
             ("urgency", " Urgency from 1 to 5:", ["1", "2", "3", "4", "5"]),
             ("refund", " Does it ask for a refund?", ["yes", "no"]),
             ("tone", " Tone:", ["calm", "annoyed", "angry"])]
INSTRUCTION = ("You triage customer support tickets for a small online shop. Read the ticket carefully, then answer "
               "the question that follows it with one word from the answers it lists, and nothing else. Ticket: ")


def rows(n: int, seed: int = 4) -> list[dict]:
    from batchgen.engines.toymodel import BENCH_WORDS

    rng = random.Random(seed)
    return [{"id": f"t{i}", "prompt": INSTRUCTION + " ".join(rng.choice(BENCH_WORDS) for _ in range(
        max(5, int(rng.lognormvariate(4.2, 0.5)))))} for i in range(n)]


def job(args: list[str]) -> tuple[float, float]:
    """(generation seconds, wall seconds) of one job in this process, into a fresh output_dir."""
    from batchgen.commands.compose import compose_checked
    from batchgen.run.runner import run_job

    out = Path(tempfile.mkdtemp(prefix="batchgen-bench-decide-"))
    try:
        summary = run_job(compose_checked([f"output_dir={out / 'o'}", "run.progress=false", *args]))
        return summary.wall_s - summary.load_s, summary.wall_s
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shape", default="bench")
    args = parser.parse_args()

    from batchgen.engines.hf.backends.cpu import runtime
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.engines.toymodel import cached_model

    runtime.keep_freed_memory()
    model = cached_model(ROOT / ".bench", args.shape)
    data = Path(tempfile.mkdtemp(prefix="batchgen-bench-data-")) / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(args.rows)))
    common = ["name=bench", f"dataset.path={data}", "dataset.format=jsonl", "dataset.id_column=id",
              f"engine.model={model}", "run.dedupe=false"]
    listed = ", ".join(f"{{name: {n}, kind: choice, prompt: {json.dumps(p)}, options: [{', '.join(o)}]}}"
                       for n, p, o in QUESTIONS)
    decide = [*common, "task=decide", f"+decide.questions=[{listed}]"]
    singles = [[*common, f"dataset.template='{{prompt}}{p}'", f"sampling.choice=[{','.join(o)}]",
                "sampling.choice_scores=true", "sampling.max_new_tokens=8"] for _, p, o in QUESTIONS]
    job(decide)  # warm: kernels, imports
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(job(decide))
        runs = [job(single) for single in singles]
        theirs.append((sum(g for g, _ in runs), sum(w for _, w in runs)))
    ratios = [t[0] / o[0] for o, t in zip(ours, theirs)]
    walls = [t[1] / o[1] for o, t in zip(ours, theirs)]
    print(describe_cpu())
    print(f"{args.shape}, {args.rows} rows, 5 questions ({sum(len(o) for *_, o in QUESTIONS)} answers)")
    print("decide generation s: " + ", ".join(f"{g:.2f}" for g, _ in ours))
    print("5 choice_scores jobs generation s: " + ", ".join(f"{g:.2f}" for g, _ in theirs))
    print("five jobs / decide, generation: " + ", ".join(f"{r:.2f}" for r in ratios)
          + f"; median {statistics.median(ratios):.2f}")
    print("five jobs / decide, wall (with 5 model loads against 1): " + ", ".join(f"{r:.2f}" for r in walls)
          + f"; median {statistics.median(walls):.2f}")


if __name__ == "__main__":
    main()
