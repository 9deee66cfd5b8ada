"""Regenerate the committed demo inputs under data/demo/ (deterministic; run once, commit the output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TASKS = [
    ("Summarize the following text in one sentence.", "summary"),
    ("Translate the following text into French.", "translation"),
    ("List three questions a reader might ask about this text.", "questions"),
    ("Classify the sentiment of this review as positive, negative or mixed.", "sentiment"),
    ("Rewrite this paragraph for a ten-year-old.", "simplify"),
    ("Extract every person, place and organisation named here.", "extraction"),
    ("Write a short title for this text.", "title"),
    ("Continue the story for two more sentences.", "story"),
]
SUBJECTS = ["the harbour", "a small bakery", "the night train", "an old lighthouse", "the city council",
            "a chess club", "the river delta", "a robotics lab", "the mountain village", "a jazz festival",
            "the public library", "a solar farm", "the annual marathon", "a museum of clocks", "the spring market"]
VERBS = ["opened", "closed", "celebrated", "rebuilt", "announced", "reviewed", "expanded", "visited", "lost",
         "restored"]
DETAILS = ["after years of debate", "despite the heavy rain", "to the surprise of many residents",
           "with help from volunteers", "under a new manager", "for the first time since 1998",
           "while tourists watched", "thanks to a generous grant", "amid rising costs", "in a single weekend"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(DETAILS)}."


def main() -> None:
    rng = random.Random(20261129)
    out = Path("data/demo")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(300):
            task, category = rng.choice(TASKS)
            text = " ".join(sentence(rng) for _ in range(int(rng.lognormvariate(1.0, 0.9)) + 1))
            row = {"id": f"demo-{i:04d}", "category": category, "instruction": task, "input": text,
                   "max_new_tokens": rng.choice([None, 16, 32, 48])}
            f.write(json.dumps(row) + "\n")
    labels = ["billing", "bug", "feature", "account", "other"]
    tickets = []
    for i in range(200):
        body = " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))
        tickets.append({"ticket_id": 10_000 + i, "customer_tier": rng.choice(["free", "pro", "enterprise"]),
                        "messages": [{"role": "user",
                                      "content": f"Ticket: {body} Please help, {rng.choice(labels)}?"}]})
    pq.write_table(pa.Table.from_pylist(tickets), out / "tickets.parquet")


if __name__ == "__main__":
    main()
