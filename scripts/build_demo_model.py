"""Build the demo's stand-in model (random-weight Llama + BPE tokenizer trained on the demo text)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from batchgen.engines.toymodel import build_model


def demo_texts(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [f"{r['instruction']}\n\n{r['input']}" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="data/models/demo-llama")
    parser.add_argument("--data", default="data/demo/prompts.jsonl")
    parser.add_argument("--size", default="small")
    args = parser.parse_args()
    out = Path(args.out)
    if (out / "config.json").exists():
        print(f"demo model already at {out}")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar: one line says what was built
    build_model(out, demo_texts(Path(args.data)), size=args.size)
    print(f"built a random-weight {args.size} Llama stand-in at {out}")


if __name__ == "__main__":
    main()
