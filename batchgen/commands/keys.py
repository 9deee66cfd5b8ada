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


# vLLM's names (every SamplingParams field of the vLLM the vLLM tier installs, and LLM.generate's arguments) -> the
# batchgen key that does the same, or "" and why there is none: `batchgen help max_tokens` answers with them, and an
# override naming one is told its key (keynames.py). docs/recipes.md's "Coming from vLLM" table lists the same.
VLLM_NAMES: dict[str, tuple[str, str]] = {
    **{name: (f"sampling.{name}", "") for name in (
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "prompt_logprobs",
        "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "logit_bias",
        "allowed_token_ids", "bad_words", "truncate_prompt_tokens")},
    "max_tokens": ("sampling.max_new_tokens", ""),
    "structured_outputs": ("sampling.json_schema", "or sampling.regex, sampling.choice, sampling.grammar"),
    "thinking_token_budget": ("sampling.max_reasoning_tokens", "with sampling.reasoning=split or auto"),
    "sampling_params": ("sampling", "the sampling section; a row's own settings: dataset.*_column"),
    "prompts": ("dataset.path", "the rows' prompts: dataset.prompt_column, template or messages_column"),
    "use_tqdm": ("run.progress", ""),
    "watermarking": ("", "not supported, because batchgen writes no output watermark"),
    "prompt_logprob_token_ids": ("", "not supported, because per-token prompt scoring is not supported yet "
                                     "(task=loglik scores a text after a prompt, summed)"),
    "prompt_logprob_start": ("", "not supported, because per-token prompt scoring is not supported yet"),
    "logprob_token_ids": ("", "not supported, because a label's probability is sampling.choice_scores's"),
    "flat_logprobs": ("", "not needed, because logprobs are written as Parquet lists"),
    "detokenize": ("", "not supported, because the text is always written"),
    "output_kind": ("", "not needed, because each sample is written once, when it is finished"),
    "stream_interval": ("", "not needed, because batchgen writes finished samples, it does not stream"),
    "skip_clone": ("", "not needed, because it is internal to vLLM"),
    "output_text_buffer_length": ("", "not needed, because vLLM sets it itself"),
    "extra_args": ("", "not supported, because it feeds custom vLLM plugins (engine.extra_args goes to vllm.LLM)"),
    "skip_reading_prefix_cache": ("", "not supported, because the prefix cache is job-wide "
                                      "(engine.enable_prefix_caching)"),
    "repetition_detection": ("", "not supported, because batchgen has no n-gram stop (sampling.repetition_penalty "
                                 "and sampling.max_new_tokens bound repetition)"),
    "routed_experts_prompt_start": ("", "not supported, because MoE routing data is not written"),
    "trace_decode_token_ids": ("", "not supported, because it is a vLLM debugging knob"),
    "lora_request": ("", "not supported, because adapters are not loaded: merge one into the weights"),
    "priority": ("", "not needed, because every row of the input is generated; order the input instead"),
    "tokenization_kwargs": ("", "not supported, because the prompt is tokenized as rendered "
                                "(sampling.truncate_prompt_tokens cuts it)"),
    "mm_processor_kwargs": ("", "not supported, because images are not supported yet"),
}


def vllm_answer(name: str) -> str:
    """What batchgen calls vLLM's `name` (VLLM_NAMES), as one line; "" for a name vLLM does not have."""
    key, why = VLLM_NAMES.get(name, ("", ""))
    if not key and not why:
        return ""
    said = f"vLLM's {name} is {key}" if key else f"vLLM's {name}: {why}"
    return said + (f" ({why})" if key and why else "")


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
    key = VLLM_NAMES.get(args.query, ("", ""))[0]
    renamed = args.query in VLLM_NAMES and key.rsplit(".", 1)[-1] != args.query  # vLLM calls it otherwise
    found = matching(key) if renamed and key else matching(args.query)
    if renamed:
        print(vllm_answer(args.query))
    if not found and not renamed:
        print(f"batchgen help: no config key matches {args.query!r}; `batchgen help SECTION` lists a section's "
              f"(dataset, engine, sampling, run, output, launcher)", file=sys.stderr)
        return 2
    if found:
        print(render(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
