"""`batchgen help [KEY | SECTION]`: what a config key means, its default, from the one source that documents the
keys: conf/reference.md, shipped in the package. docs/configuration.md's "Config reference" is generated
from the same file (`python -m batchgen.commands.keys --write-docs`; tests/test_docs.py fails when they differ), so
the help and the docs cannot drift.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

from batchgen.confdir import conf_dir

REFERENCE = conf_dir() / "reference.md"
DOCS_BEGIN = "<!-- generated from conf/reference.md: python -m batchgen.commands.keys --write-docs -->"
DOCS_END = "<!-- end of the generated reference -->"


class Row(NamedTuple):
    keys: list[str]  # the keys documented together (`sampling.temperature`, `sampling.top_p`, ...)
    default: str
    meaning: str


def table() -> list[str]:
    """The reference's Markdown table lines, its header included."""
    return [line for line in REFERENCE.read_text(encoding="utf-8").splitlines() if line.startswith("|")]


def rows() -> list[Row]:
    out = []
    for line in table()[2:]:
        key, default, meaning = (cell.strip() for cell in line.strip("|").split(" | ", 2))
        out.append(Row(re.findall(r"`([^`]+)`", key), default, meaning.rstrip("|").strip()))
    return out


def matching(query: str) -> list[Row]:
    """The rows of `query`: a key (dataset.template), a section (dataset: its group row and every dataset.* key) or
    any part of a key's name (prefix_cache)."""
    exact = [r for r in rows() if query in r.keys]
    if exact and "." in query:
        return exact
    return [r for r in rows() if any(k == query or k.startswith(f"{query}.") for k in r.keys)] or [
        r for r in rows() if any(query in k for k in r.keys)]


def plain(text: str) -> str:
    """A Markdown cell as terminal text: links as their text, backticks dropped."""
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", text).replace("`", "")


def render(found: list[Row], width: int = 100) -> str:
    parts = []
    for r in found:
        parts.append(f"{', '.join(r.keys)}  [default: {plain(r.default)}]\n" + textwrap.fill(
            plain(r.meaning), width, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(parts)


def docs_block() -> str:
    return "\n".join([DOCS_BEGIN, *table(), DOCS_END])


def write_docs(path: Path) -> bool:
    """Put the reference into `path` between the markers; whether the file changed."""
    text = path.read_text(encoding="utf-8")
    begin, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:begin] + docs_block() + text[end:]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen help", description=__doc__.split("\n\n")[0])
    parser.add_argument("query", nargs="?", help="a key (dataset.template), a section (sampling) or part of a name")
    parser.add_argument("--write-docs", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_docs:
        print(f"{args.write_docs}: {'updated' if write_docs(args.write_docs) else 'up to date'}")
        return 0
    if not args.query:
        parser.print_help()
        return 0
    found = matching(args.query)
    if not found:
        print(f"batchgen help: no config key matches {args.query!r}; `batchgen help SECTION` lists a section's "
              f"(dataset, engine, sampling, run, output, launcher)", file=sys.stderr)
        return 2
    print(render(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
