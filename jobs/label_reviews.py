"""A Python job: label product reviews as positive, negative or mixed, with the prompt built by a function.

    python jobs/label_reviews.py --data reviews.parquet --model path/to/model --out data/outputs/reviews

What a YAML preset cannot do is code: here `render` reads several columns, skips the empty ones and builds a
chat conversation; a row it cannot render (it raises) becomes that row's `bad_render` error, the job goes on.
Everything else is batchgen's: streaming, the engine, resume after a kill (rerun the same command), the output
layout and the exit codes of docs/contract.md (0 done, 1 failed, 2 config or input error).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from batchgen import BatchgenError, JobConfig, run_job  # noqa: E402

LABELS = ("positive", "negative", "mixed")


def render(row: dict) -> list[dict]:
    """A review row -> chat messages. Title and body are optional each, but not both."""
    parts = [str(row[k]).strip() for k in ("title", "body") if row.get(k) and str(row[k]).strip()]
    if not parts:
        raise ValueError("the review has neither a title nor a body")
    return [{"role": "system", "content": f"Answer with one word: {', '.join(LABELS)}."},
            {"role": "user", "content": "Review:\n" + "\n".join(parts) + "\nSentiment:"}]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="Parquet or JSONL file, directory or glob of reviews")
    parser.add_argument("--model", required=True, help="model directory (with a chat template)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    cfg = JobConfig(name="label_reviews", output_dir=args.out)
    cfg.dataset.path, cfg.dataset.id_column = args.data, "review_id"
    cfg.engine.model = args.model
    cfg.sampling.max_new_tokens = args.max_new_tokens
    cfg.run.progress = False
    try:
        summary = run_job(cfg, render_row=render)
    except BatchgenError as exc:
        print(f"label_reviews: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(summary.render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
