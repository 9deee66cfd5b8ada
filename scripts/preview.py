"""Print the first rows of a batchgen output directory and check its row count against the input."""

from __future__ import annotations

import argparse
import sys

import pyarrow.dataset as ds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output_dir")
    parser.add_argument("--expect-rows", type=int)
    parser.add_argument("--rows", type=int, default=5)
    args = parser.parse_args()
    table = ds.dataset(args.output_dir, format="parquet").to_table()
    cols = ["id", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "generation"]
    print(f"{args.output_dir}: {table.num_rows} rows, columns: {', '.join(table.column_names)}")
    for row in table.select(cols).slice(0, args.rows).to_pylist():
        text = (row["generation"] or "").replace("\n", " ")
        print(f"  {row['id']:<12} {row['finish_reason']:<7} prompt={row['num_prompt_tokens']:<4} "
              f"gen={row['num_generated_tokens']:<4} {text[:70]!r}")
    if args.expect_rows is not None and table.num_rows != args.expect_rows:
        print(f"expected {args.expect_rows} rows, found {table.num_rows}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
