"""`batchgen plan [--calibrate] [--show N] [job=NAME] [key=value ...]`: what a job would do, before it runs. It
streams the input and tokenizes every prompt without loading the model, then prints (and writes to
output_dir/_plan.json, with the histogram as _plan.png where matplotlib is installed):

- the prompt-length histogram;
- the rows over max_model_len - max_new_tokens, and what run.too_long will do with them;
- the rows that would be error rows, by kind;
- total prompt tokens and the most tokens the job can generate;
- parts, and parts per shard.

Without a tokenizer (engine=openai's chat endpoint and no engine.tokenizer) the token figures are estimates from
characters (about 4 a token), marked so: the rows over max_model_len are the ones that may be, and the job sends them
all (the server refuses a prompt too long for it), so they do not make the plan's exit code.

`--show N` first prints the first N rows' prompts as the engine gets them, with id, token count and what run.too_long
does to each (a prompt's lines after `| `, escaped for the terminal; exact in _plan.json's `shown`).
`--calibrate` then loads the engine and runs a short probe on the longest prompts first (an out-of-memory shows at
once), and prints its rate and an ETA for the whole job (an estimate on the machine as it is, not a bound). Exit
codes are the job's: 0 when it would run, 1 when it would stop (run.too_long=fail with a row too long, or more error
rows than run.max_error_rate), 2 on a config or input error.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchgen.commands.terminal import block, one_line
from batchgen.engines.base import model_max_len
from batchgen.errors import ConfigError, TooLongError
from batchgen.fsutil import write_json_atomic
from batchgen.job import JobConfig
from batchgen.output.input_index import save_input_index
from batchgen.output.rows.stats import error_kind
from batchgen.prompts.planner import Measured, Planner
from batchgen.run.preflight import load_tokenizer
from batchgen.run.prepare import open_input

PROBE_ROWS = 16  # rows of the calibration probe: the longest prompts
Probe = tuple[int, list[int], Optional[list[dict]]]  # a generable row: (its cap, prompt ids, chat messages or None)
ESTIMATED = "estimated from characters: no engine.tokenizer"
ETA_CAVEAT = ("an estimate on this machine as it is now, not a bound: a busier machine, or samples that run longer "
              "than the greedy probe's, take longer")


def model_len(cfg: JobConfig) -> int:
    """engine.max_model_len, or the model's own from its config.json (no weights loaded); for an endpoint, what its
    /v1/models says (one GET)."""
    if cfg.engine.max_model_len:
        return cfg.engine.max_model_len
    if cfg.engine.name == "openai":
        from batchgen.engines.endpoint.engine import served_max_len

        return served_max_len(cfg.engine)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.engine.model, trust_remote_code=cfg.engine.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError([config_problem(cfg, exc)]) from exc
    return model_max_len(getattr(config, "text_config", None) or config)


def config_problem(cfg: JobConfig, exc: Exception) -> str:
    """What to do when the model's config.json does not load: its own code not trusted, or a model type this
    transformers does not know (transformers' message, in one line, says which)."""
    said = " ".join(str(exc).split())
    if "trust_remote_code" in said:
        return (f"engine.model: {cfg.engine.model} needs its own Python code to load (auto_map in its config.json); "
                f"set engine.trust_remote_code=true if you trust that code, or use a model transformers supports")
    first = said.split(". ")[0]
    if isinstance(exc, OSError):
        return f"engine.model: cannot read the model config of {cfg.engine.model}: {first}"
    return (f"engine.model: cannot read the model config of {cfg.engine.model}: {first}; a model type this "
            f"transformers does not know needs a newer one (pip install -U transformers)")


def open_planner(cfg: JobConfig) -> tuple[Planner, int]:
    """The job's own planner over every part (the plan counts what the job would read, skipped rows too), and the
    model's max_model_len; a JSONL input's pass saved for the job's shards (input_index.INPUT_INDEX)."""
    whole = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, shard=0, num_shards=1))  # every part
    out = Path(cfg.output_dir)
    job = open_input(cfg, out, skip_existing=False)
    limit = model_len(cfg)  # before anything is written: a config.json that does not load is a ConfigError
    if "://" not in cfg.output_dir:
        out.mkdir(parents=True, exist_ok=True)
        save_input_index(out, job.reader)
    return Planner(whole, job.reader, job.renderer, job.tokenizer), limit


@dataclass
class Tally:
    """What the plan counts over the rows as it streams them."""

    lengths: list[int] = field(default_factory=list)  # each generable row's prompt tokens
    errors: Counter[str] = field(default_factory=Counter)  # error rows by kind
    over: list[str] = field(default_factory=list)  # ids of the rows past max_model_len - max_new_tokens
    rows: list[Probe] = field(default_factory=list)  # every generable row as the probe sends it
    max_generated: int = 0
    fitted: int = 0  # prompt tokens after run.too_long: what the job's num_prompt_tokens will sum to


def measure(cfg: JobConfig, show: int = 0) -> tuple[dict[str, Any], list[Probe]]:
    """The plan's figures (with `show`, the first rows' prompts: shown_row), and every generable row as the probe
    sends it."""
    planner, limit = open_planner(cfg)
    tally, shown = Tally(), []
    for part in planner.parts(skip=set()):
        m = planner.measure(part)
        for i in range(len(m.errors)):
            if len(shown) < show:
                shown.append(shown_row(planner, part.ids[i], m, i, limit))
            _count(cfg, planner, tally, part.ids[i], m, i, limit)
    return _figures(cfg, planner, tally, limit, shown if show else None), tally.rows


def _count(cfg: JobConfig, planner: Any, tally: Tally, row_id: str, m: Any, i: int, limit: int) -> None:
    """Row i of a measured part into the tally, as the job would treat it under its own run.too_long."""
    error, setting, ids = m.errors[i], m.settings[i], m.ids[i]
    if error is not None:
        tally.errors[error_kind(error)] += 1
        return
    tally.lengths.append(len(ids))
    if len(ids) > limit - setting.max_new_tokens:
        tally.over.append(row_id)
    try:  # the job's own run.too_long policy (planner.fit): what its num_prompt_tokens will sum to
        kept, too_long = planner.fit(ids, setting.max_new_tokens, limit, row_id, cuttable=not planner.sends_messages)
    except TooLongError:
        return  # run.too_long=fail: the job stops at this row
    if too_long is not None:
        return  # a too_long error row in the job
    tally.fitted += len(kept)
    tally.max_generated += setting.max_new_tokens * cfg.sampling.n if cfg.task == "generate" else 0
    tally.rows.append((setting.max_new_tokens, ids, sent_messages(planner, m, i)))


def _figures(cfg: JobConfig, planner: Any, tally: Tally, limit: int, shown: Optional[list[dict[str, Any]]]
             ) -> dict[str, Any]:
    """The plan as _plan.json holds it."""
    lengths, parts, shards = tally.lengths, planner.total_parts, cfg.run.num_shards
    too_long = {"rows": len(tally.over), "policy": cfg.run.too_long, "first_ids": tally.over[:10],
                "what_happens": _too_long_effect(cfg.run.too_long, len(tally.over), planner.tokenizer is None)}
    return {
        "rows": planner.total_rows, "generable_rows": len(lengths), "error_rows": dict(tally.errors),
        "prompt_tokens": sum(lengths), "prompt_tokens_after_fit": tally.fitted,
        "max_generated_tokens": tally.max_generated, "prompt_length": _summary(lengths),
        "histogram": histogram(lengths), "max_model_len": limit, "too_long": too_long,
        **({"prompt_tokens_estimated": True} if planner.tokenizer is None else {}),
        **_cost(cfg, tally.fitted, tally.max_generated),
        "parts": parts, "rows_per_part": cfg.rows_per_part,
        "shards": {"num_shards": shards, "parts_per_shard": [len(range(k, parts, shards)) for k in range(shards)]},
        **({"shown": shown} if shown is not None else {}),
    }


def sent_messages(planner: Planner, m: Measured, i: int) -> Optional[list[dict]]:
    """Row `i`'s chat messages as engine=openai's chat endpoint is sent them (the planner's own rule); None where the
    engine is sent token ids."""
    if not planner.sends_messages:
        return None
    return m.messages[i] or [{"role": "user", "content": m.texts[i]}]


def shown_row(planner: Planner, row_id: str, m: Measured, i: int, limit: int) -> dict[str, Any]:
    """Row `i` of a measured part for `--show`: its prompt as the job's renderer made it (what the engine is given,
    tokenized), its token count, and what the job's own run.too_long (planner.fit) does to it; or its error."""
    if m.errors[i] is not None:
        return {"id": row_id, "prompt": m.texts[i], "prompt_tokens": None, "error": m.errors[i], "too_long": None}
    ids = m.ids[i]
    try:
        kept, why = planner.fit(ids, m.settings[i].max_new_tokens, limit, row_id, cuttable=not planner.sends_messages)
    except TooLongError:
        kept, why = [], "run.too_long=fail: the job stops at this row (exit 1)"
    if why is None and len(kept) < len(ids):
        why = f"run.too_long=truncate_left: the engine gets its last {len(kept)} tokens (BOS kept)"
    elif why is not None and not why.startswith("run.too_long"):
        why = f"run.too_long={planner.cfg.run.too_long}: not generated ({why})"
    return {"id": row_id, "prompt": m.texts[i], "prompt_tokens": len(ids), "error": None, "too_long": why}


def render_shown(shown: list[dict[str, Any]], estimated: bool = False) -> str:
    """`--show`'s rows: a header line each (row, id, tokens, too_long), then the prompt, its lines after `| `, row data
    escaped (without a tokenizer, `estimated`: a chat row's messages as JSON, its tokens estimated)."""
    out = []
    for k, row in enumerate(shown):
        cut = f"; {row['too_long']}" if row["too_long"] else ""
        tokens = f"about {row['prompt_tokens']} prompt tokens ({ESTIMATED})" if estimated else (
            f"{row['prompt_tokens']} prompt tokens")
        what = row["error"] or f"{tokens}{cut}"
        out.append(f"--- row {k}: id {one_line(row['id'])}, {one_line(what)} ---")
        if row["prompt"] is not None and row["error"] is None:
            out.append(block(row["prompt"]))
    return "\n".join([*out, f"--- end of the {len(shown)} rows shown ---"])


def _cost(cfg: JobConfig, prompt_tokens: int, generated_tokens: int) -> dict[str, Any]:
    """output.prices: the job's cost if every sample generates its cap and no prompt token comes from a cache (each
    sample's request carries its row's prompt): an upper bound, as `max_generated_tokens` is."""
    prices = cfg.output.priced()
    if prices is None:
        return {}
    return {"cost_estimate": (prompt_tokens * cfg.sampling.n * prices.input + generated_tokens * prices.output) / 1e6}


def _summary(lengths: list[int]) -> dict[str, Any]:
    if not lengths:
        return {"min": None, "median": None, "p95": None, "max": None}
    ordered = sorted(lengths)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "p95": ordered[min(len(ordered) - 1,
            math.ceil(0.95 * len(ordered)) - 1)], "max": ordered[-1]}


def histogram(lengths: list[int]) -> list[dict[str, int]]:
    """Prompt lengths in power-of-two buckets [lo, hi]."""
    counts: Counter[int] = Counter(max(0, math.ceil(math.log2(max(n, 1)))) for n in lengths)
    return [{"lo": 1 if b == 0 else 2 ** (b - 1) + 1, "hi": 2 ** b, "rows": counts[b]}
            for b in range(min(counts, default=0), max(counts, default=-1) + 1)]


def _too_long_effect(policy: str, rows: int, estimated: bool = False) -> str:
    if estimated:
        return (f"{rows} prompts may be too long by the estimate; without engine.tokenizer run.too_long is not "
                f"checked before sending: the server refuses a prompt too long for it, an endpoint_rejected error row")
    if not rows:
        return "none: every prompt fits"
    return {"truncate_left": f"{rows} prompts will be cut to their last tokens (BOS kept)",
            "skip": f"{rows} rows will be too_long error rows",
            "fail": f"the job would stop at the first of these {rows} rows (exit 1)"}[policy]


def calibrate(cfg: JobConfig, plan: dict[str, Any], rows: list[Probe]) -> dict[str, Any]:
    """Load the engine, generate the longest prompts (PROBE_ROWS of them, each with its own cap), and estimate the
    job's time from the probe's rows/s. An estimate, not a bound: the longest prompts make it high, but the probe is
    greedy (samples may run longer) and measures the machine as it is now (a busier one, or a node shared with other
    jobs, runs slower)."""
    from batchgen.engines import build_engine
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    s = cfg.sampling
    started = time.perf_counter()
    engine = build_engine(cfg.engine, load_tokenizer(cfg))
    load_s = time.perf_counter() - started
    longest = sorted(rows, key=lambda r: -len(r[1]))[:PROBE_ROWS]
    room = engine.max_model_len
    requests = [Request(key=k, prompt_ids=ids[-max(room - cap, 1):], seed=None, messages=messages, params=SampleParams(
        max_new_tokens=cap, temperature=0.0, top_p=1.0, top_k=0, stop=tuple(s.stop), ignore_eos=s.ignore_eos))
        for k, (cap, ids, messages) in enumerate(longest)]
    started = time.perf_counter()
    results = engine.generate(requests) if requests else []
    probe_s = time.perf_counter() - started
    engine.close()
    generated = sum(r.num_generated_tokens for r in results)
    rows_per_s = len(results) / probe_s if results else None
    samples = plan["generable_rows"] * s.n
    return {"load_s": round(load_s, 1), "probe_rows": len(results), "probe_s": round(probe_s, 2),
            "probe_tok_s": round(generated / probe_s, 1) if results else None,
            "eta_s": round(samples / rows_per_s, 3) if rows_per_s else None}


def render(plan: dict[str, Any]) -> str:
    n = plan["prompt_length"]
    lines = [f"rows {plan['rows']} ({plan['generable_rows']} to generate), error rows: "
             f"{', '.join(f'{k}={v}' for k, v in sorted(plan['error_rows'].items())) or 'none'}",
             f"prompt tokens {plan['prompt_tokens']} (min {n['min']}, median {n['median']}, p95 {n['p95']}, max "
             f"{n['max']}{'; ' + ESTIMATED if plan.get('prompt_tokens_estimated') else ''}), "
             f"{plan['prompt_tokens_after_fit']} after run.too_long; at most "
             f"{plan['max_generated_tokens']} generated tokens"
             + (f"; cost at most {plan['cost_estimate']:.6g} (output.prices: every sample at its cap, no prompt "
                f"cache)" if "cost_estimate" in plan else ""),
             f"max_model_len {plan['max_model_len']}: {plan['too_long']['rows']} rows over max_model_len - "
             f"max_new_tokens (run.too_long={plan['too_long']['policy']}: {plan['too_long']['what_happens']})",
             f"parts {plan['parts']} of {plan['rows_per_part']} rows; shards {plan['shards']['num_shards']}: "
             f"{', '.join(map(str, plan['shards']['parts_per_shard']))} parts each",
             "prompt length histogram (tokens: rows):"]
    most = max((b["rows"] for b in plan["histogram"]), default=0) or 1
    for b in plan["histogram"]:
        bar = "#" * max(1 if b["rows"] else 0, 50 * b["rows"] // most)
        lines.append(f"  {b['lo']:>6}-{b['hi']:<6} {b['rows']:>8} {bar}")
    c = plan.get("calibration")
    if c:
        eta = "unknown" if c["eta_s"] is None else f"{c['eta_s']:.0f} s ({c['eta_s'] / 3600:.2f} h)"
        lines.append(f"calibration: {c['probe_rows']} longest rows in {c['probe_s']} s ({c['probe_tok_s']} tok/s; "
                     f"model load {c['load_s']} s); ETA for the whole job at that rate: {eta} ({ETA_CAVEAT})")
    return "\n".join(lines)


def write_png(plan: dict[str, Any], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{b['lo']}-{b['hi']}" for b in plan["histogram"]]
    ax.bar(labels, [b["rows"] for b in plan["histogram"]], color="#4C72B0")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("rows")
    ax.set_title(f"prompt lengths: {plan['generable_rows']} rows, max_model_len {plan['max_model_len']}")
    ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_plan(cfg: JobConfig, calibrate_engine: bool = False, show: int = 0) -> tuple[dict[str, Any], int]:
    """The plan (written to output_dir/_plan.json and _plan.png; with `show`, the first rows' prompts) and the exit
    code the job would have."""
    plan, rows = measure(cfg, show)
    if calibrate_engine:
        plan["calibration"] = calibrate(cfg, plan, rows)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "_plan.json", plan)
    plan["png"] = str(write_png(plan, out / "_plan.png") or "")
    over = 0 if plan.get("prompt_tokens_estimated") else plan["too_long"]["rows"]  # estimated: the server judges
    error_rows = sum(plan["error_rows"].values()) + (over if cfg.run.too_long == "skip" else 0)
    fails = (cfg.run.too_long == "fail" and over) or (
        plan["rows"] and error_rows / plan["rows"] > cfg.run.max_error_rate)
    return plan, 1 if fails else 0


def main(argv: list[str], compose_checked: Callable[[list[str]], JobConfig]) -> int:
    """The CLI's `batchgen plan`; `compose_checked` (cli.py, the one module that knows Hydra) makes the config."""
    from batchgen.errors import BatchgenError

    if "-h" in argv or "--help" in argv:
        print(f"usage: batchgen plan [--calibrate] [--show N] [job=NAME] [key=value ...]\n\n"
              f"{__doc__.split(':', 1)[1].strip()}")
        return 0
    show, argv = take_show(argv)
    if show < 0:
        print("batchgen plan: error: --show N: N is how many rows to show, a whole number", file=sys.stderr)
        return 2
    unknown = [a for a in argv if a.startswith("-") and a != "--calibrate"]
    if unknown:
        print(f"batchgen plan: error: unknown option {unknown[0]} (batchgen plan --help)", file=sys.stderr)
        return 2
    calibrate_engine = "--calibrate" in argv
    overrides = [a for a in argv if a != "--calibrate"]
    try:
        cfg = compose_checked(overrides)
        plan, code = run_plan(cfg, calibrate_engine, show)
    except BatchgenError as exc:
        print(f"batchgen plan: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if show:
        print(render_shown(plan["shown"], plan.get("prompt_tokens_estimated", False)))
    print(render(plan))
    print(f"plan written to {Path(cfg.output_dir) / '_plan.json'}" + (f" and {plan['png']}" if plan["png"] else
                                                                     " (pip install matplotlib for _plan.png)"))
    if code:
        print("batchgen plan: the job would stop (see above)", file=sys.stderr)
    return code



def take_show(argv: list[str]) -> tuple[int, list[str]]:
    """`--show N` / `--show=N` taken out of argv: N (0 without it, -1 where N is not a whole number >= 0)."""
    rest, show, i = [], 0, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--show" or arg.startswith("--show="):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            show = int(value) if value.isdigit() else -1
            continue
        rest.append(arg)
        i += 1
    return show, rest
