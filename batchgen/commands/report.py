"""`batchgen report OUTPUT_DIR [--out FILE]`: one self-contained HTML page of what a run did, from the files on
disk: throughput over time (the runs' history, `_history*.jsonl`), prompt and generation length histograms, finish
reasons, error kinds with example rows, per-shard and per-worker progress, retries, the config and the model. Its
throughput figure is each shard's last run's, from its status file, said as the summary and `batchgen status` say it
(output/throughput.py: generated tokens over generation time after load; rows and prompt tokens for a scoring task).

The plots are inline SVG (matplotlib, in the base install; where it cannot be imported the page has the tables
only) and the page loads nothing from the network. Written to OUTPUT_DIR/_report.html by default. The rows are read
through the latest-attempt view, a column at a time (lengths, finish reasons and errors; the generations of the
first ten rows only, for the example table).
An output on object storage (`s3://...`, through fsspec) is read the same way from a local copy of those columns,
its manifest and status files (status.fetch_remote) and the history its staging directory holds on this machine;
its page goes where --out says (nothing is written into the bucket). Knows the output layout, not engines.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

from batchgen.errors import BadPartError, ConfigError
from batchgen.output.heartbeat import read_heartbeats
from batchgen.output.manifest import MANIFEST, read_manifest
from batchgen.output.remote import RemoteOutput, is_remote
from batchgen.output.tables import table_line
from batchgen.output.throughput import throughput, work_from
from batchgen.output.view import attempt_dir, attempts, latest_batches
from batchgen.redact import redact, redact_text

REPORT = "_report.html"
HISTORY_GLOB = "_history*.jsonl"
EXAMPLES = 3  # rows shown per error kind
ROW_COLUMNS = ("id", "sample_index", "finish_reason", "num_prompt_tokens", "num_generated_tokens", "error")  # read
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def history(output_dir: Path) -> list[dict[str, Any]]:
    """Every committed part's history record, all runs and shards, in time order (a torn last line skipped),
    with made_tokens: the tokens its run generated while it was in flight (less those an earlier run journaled)."""
    out = []
    for path in sorted(output_dir.glob(HISTORY_GLOB)):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(record := json.loads(line))
            except ValueError:
                continue  # a run killed while appending: its last line is torn
            record["made_tokens"] = record.get("generated_tokens", 0) - record.get("reused_tokens", 0)
    return sorted(out, key=lambda r: r.get("t", 0))


def gather(output_dir: Path) -> dict[str, Any]:
    """The facts the page shows."""
    manifest = redact(read_manifest(output_dir))  # one written before a secret name was masked shows it masked
    if manifest is None:
        raise ConfigError([f"{output_dir}: no batchgen output here (no {MANIFEST})"])
    prompt, generated, reasons = [], [], Counter()
    errors: dict[str, list[tuple[str, str]]] = defaultdict(list)
    counts: Counter = Counter()
    rows = 0
    for table in latest_batches(output_dir, columns=list(ROW_COLUMNS)):
        cols = {c: table.column(c).to_pylist() for c in table.column_names}
        for i in range(table.num_rows):
            reasons[cols["finish_reason"][i]] += 1
            generated.append(cols["num_generated_tokens"][i])
            if cols["sample_index"][i] == 0:
                rows += 1
                if cols["finish_reason"][i] != "error":  # an error row was never tokenized for the engine
                    prompt.append(cols["num_prompt_tokens"][i])
            error = cols["error"][i]
            if error is not None:
                kind = error.split(":", 1)[0]
                counts[kind] += 1
                if len(errors[kind]) < EXAMPLES:
                    errors[kind].append((cols["id"][i], error))
    retries = []
    for a in attempts(output_dir)[1:]:
        here = attempt_dir(output_dir, a)
        recorded = json.loads((here / "_retry.json").read_text()) if (here / "_retry.json").exists() else {}
        retries.append({"attempt": a, "complete": (here / "_SUCCESS").exists(), **recorded,
                        "tokens": sum(h.get("generated_tokens", 0) for h in history(here))})  # its own history
    return {"manifest": manifest, "rows": rows, "samples": len(generated), "prompt": prompt, "generated": generated,
            "reasons": reasons, "errors": errors, "error_counts": counts, "history": history(output_dir),
            "beats": [(p.name, b) for p, b in read_heartbeats(output_dir)], "retries": retries,
            "examples": example_rows(output_dir), "table": table_line(manifest),
            "complete": (output_dir / "_SUCCESS").exists()}


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    import matplotlib.pyplot as plt  # matplotlib made `fig`: importable here
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # inline: without the XML prolog


def plots(facts: dict[str, Any]) -> dict[str, str]:
    """Inline SVGs by name; empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out = {}
    if facts["history"]:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
        _throughput(ax1, ax2, facts["history"])
        out["throughput"] = _svg(fig)
    for name, values, title, unit in (("prompt", facts["prompt"], "prompt tokens per row", "rows"),
                                      ("generated", facts["generated"], "generated tokens per sample", "samples")):
        if values:
            fig, ax = plt.subplots(figsize=(5, 3))
            ax.hist(values, bins=min(30, max(len(set(values)), 1)), color=COLORS[0 if name == "prompt" else 2])
            ax.set_title(title)
            ax.set_xlabel(title.split(" per ")[0])
            ax.set_ylabel(unit)
            out[name] = _svg(fig)
    if facts["reasons"]:
        fig, ax = plt.subplots(figsize=(5, 3))
        names = sorted(facts["reasons"])
        ax.bar(names, [facts["reasons"][n] for n in names], color=COLORS[1])
        ax.set_title("finish reasons (samples)")
        ax.set_xlabel("finish_reason")
        ax.set_ylabel("samples")
        out["reasons"] = _svg(fig)
    return out


RATE_BINS = 12  # the generated-tokens rate is drawn over this many equal spans of the job's time


def job_start(hist: list[dict[str, Any]]) -> float:
    """When the first run began generating: its first part's commit time less that part's time in flight."""
    return min(h["t"] - (h.get("part_s") or 0) for h in hist)


def _throughput(ax1: Any, ax2: Any, hist: list[dict[str, Any]]) -> None:
    """Cumulative generated tokens per worker, and the job's generated tokens per second over equal spans of time
    (the engine's rate, every part in flight together; not a part's tokens over its own time in flight, which
    undercounts by the parts that share the engine). Time from the job's start: nothing left of zero."""
    t0 = job_start(hist)
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for h in hist:
        by_worker[_worker(h)].append(h)
    for k, (worker, items) in enumerate(sorted(by_worker.items())):
        total, xs, ys = 0, [0.0], [0]
        for h in items:
            total += h["made_tokens"]
            xs.append(h["t"] - t0)
            ys.append(total)
        ax1.plot(xs, ys, marker="o", ms=3, color=COLORS[k % len(COLORS)], label=worker)
    ax1.set_title("generated tokens (cumulative)")
    ax1.set_ylabel("tokens")
    end = max(h["t"] for h in hist) - t0 or 1.0
    width = end / RATE_BINS
    tokens = [0.0] * RATE_BINS
    for h in hist:  # a part's tokens spread over its time in flight, clipped to the job's span
        start, stop = h["t"] - t0 - (h.get("part_s") or 0), h["t"] - t0
        for i in range(RATE_BINS):
            overlap = min(stop, (i + 1) * width) - max(start, i * width)
            if stop == start and i * width <= stop <= (i + 1) * width:
                overlap = 1.0 if i == min(int(stop / width), RATE_BINS - 1) else 0.0
            if overlap > 0:
                tokens[i] += h["made_tokens"] * (overlap / (stop - start) if stop > start else 1.0)
    ax2.bar([i * width for i in range(RATE_BINS)], [t / width for t in tokens], width=width, align="edge",
            color=COLORS[0])
    ax2.set_title("generated tokens per second (all parts in flight)")
    ax2.set_ylabel("tok/s")
    for ax in (ax1, ax2):
        ax.set_xlabel("seconds since the job started")
        ax.set_xlim(left=0)
    if len(by_worker) > 1:
        ax1.legend(fontsize=7)


def _worker(h: dict[str, Any]) -> str:
    return h.get("worker") or f"{h.get('host', '?')}:{h.get('pid', '?')}"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{f'<tr>{cells}</tr>' if any(head) else ''}{body}</table>"


def render(output_dir: str | Path, facts: dict[str, Any]) -> str:
    """The page: a summary, the plots, then tables of errors, shards, workers, retries, model and config."""
    m = facts["manifest"]
    svg = plots(facts)
    errors_total = sum(facts["error_counts"].values())
    sections = [
        "<h2>Summary</h2>" + _table(["", ""], _summary_rows(facts)),
        "<h2>Throughput over time</h2>" + _throughput_section(facts, svg),
        "<h2>Lengths</h2><div class='row'>" + svg.get("prompt", "") + svg.get("generated", "") + "</div>",
        "<h2>Finish reasons</h2><div class='row'>" + svg.get("reasons", "") + _table(
            ["finish_reason", "samples"], sorted(facts["reasons"].items())) + "</div>",
        "<h2>Errors</h2>" + (_table(["kind", "samples", "examples (id: error)"],
                                    [[k, n, " | ".join(f"{i}: {e[:160]}" for i, e in facts["errors"][k])]
                                     for k, n in facts["error_counts"].most_common()]) if errors_total
                             else "<p>none</p>"),
        "<h2>Example rows</h2>" + _table(["id", "input columns kept in the output", "generation", "finish_reason"],
                                          facts["examples"]),
        *_run_sections(facts),
        "<h2>Model</h2><pre>" + html.escape(json.dumps({"model": m.get("model"), "engine": m.get("engine_resolved")},
                                                       indent=2)) + "</pre>",
        "<h2>Config</h2><pre>" + html.escape(json.dumps(m.get("config"), indent=2, default=str)) + "</pre>",
    ]
    title = html.escape(f"batchgen report: {output_dir}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style></head>"
            f"<body><h1>{title}</h1>{''.join(sections)}</body></html>")


STYLE = ("body{font-family:sans-serif;margin:24px;max-width:1100px} table{border-collapse:collapse;margin:8px 0}"
         "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left} pre{background:#f5f5f5;"
         "padding:8px;font-size:12px;overflow:auto} .row{display:flex;gap:16px;align-items:flex-start}"
         " svg{max-width:100%;height:auto}")


def _throughput_section(facts: dict[str, Any], svg: dict[str, str]) -> str:
    if svg.get("throughput"):
        return svg["throughput"]
    hist = facts["history"]
    if not hist:
        return "<p>no history recorded (a run older than the history file, or no part committed yet)</p>"
    span = max(h["t"] for h in hist) - job_start(hist)
    tokens = sum(h.get("generated_tokens", 0) for h in hist)
    rates = "; ".join(f"{name}: {figure}" for name, figure in figures(facts["beats"])) or "not recorded"
    return (f"<p>{len(hist)} parts committed, {tokens} tokens generated over {span:.1f} s; throughput (the last "
            f"run, after load) {html.escape(rates)}. The plots need matplotlib: pip install matplotlib</p>")


def figures(beats: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Each shard's throughput figure (its status file's last run, after load), as the summary said it; a status
    file of a batchgen older than the figure's record has none."""
    return [(name, throughput(work)) for name, beat in beats if (work := work_from(beat.this_run)) is not None]


def example_rows(output_dir: Path, count: int = 10) -> list[list[str]]:
    """The first `count` rows of the latest view (sample 0): id, the input columns the output keeps (excerpts),
    the generation's start, the finish reason. The page escapes them."""
    contract = set(ROW_COLUMNS) | {"generation", "seed", "attempt", "parsed", "choice_scores", "logprobs",
                                   "reasoning"}
    out: list[list[str]] = []
    for table in latest_batches(output_dir):
        for row in table.to_pylist():
            if row.get("sample_index", 0) != 0:
                continue
            inputs = "; ".join(f"{k}: {str(v)[:80]}" for k, v in row.items() if k not in contract and v is not None)
            out.append([row["id"], inputs[:240], (row.get("generation") or "")[:200], row["finish_reason"]])
            if len(out) == count:
                return out
    return out


def _summary_rows(facts: dict[str, Any]) -> list[list[Any]]:
    m, hist = facts["manifest"], facts["history"]
    span = hist[-1]["t"] - hist[0]["t"] + (hist[0].get("part_s") or 0) if hist else 0
    return [["state", "complete" if facts["complete"] else "incomplete"], ["rows", facts["rows"]],
            ["samples", facts["samples"]],
            ["error samples (latest view: after retries)", sum(facts["error_counts"].values())],
            ["rows skipped (run.skip_existing)", sum(b.rows_skipped for _, b in facts["beats"])],
            ["invalid outputs", sum(b.invalid_outputs for _, b in facts["beats"])],
            ["generated tokens (history, retries included)", sum(h.get("generated_tokens", 0) for h in hist)
             + sum(r["tokens"] for r in facts["retries"])],
            *([["cost (history; output.prices)", f"{sum(h.get('cost', 0) for h in hist):.6g}"]]
              if any("cost" in h for h in hist) else []),
            *([["rows needing review (history; task=decide)", sum(h.get("needs_review", 0) for h in hist)]]
              if any("needs_review" in h for h in hist) else []),
            ["generation time (first to last commit)", f"{span:.1f} s"],
            ["throughput (the last run of each shard, after load)",
             "; ".join(f"{name}: {figure}" for name, figure in figures(facts["beats"])) or "not recorded"],
            *([["table output", facts["table"]]] if facts.get("table") else []),
            ["batchgen", m.get("batchgen_version")], ["config hash", m.get("config_hash")]]


def _run_sections(facts: dict[str, Any]) -> list[str]:
    """Who ran the job: the shards' status files, the workers' totals from the history, the retries."""
    workers: dict[str, dict[str, float]] = defaultdict(lambda: {"parts": 0, "rows": 0, "tokens": 0})
    for h in facts["history"]:
        w = workers[_worker(h)]
        w["parts"] += 1
        w["rows"] += h.get("rows", 0)
        w["tokens"] += h["made_tokens"]
    said = dict(figures(facts["beats"]))
    shard_rows = [[name, b.state, f"{b.rows_done}/{b.rows_total if b.rows_total is not None else '?'}",
                   b.rows_failed, b.generated_tokens, said.get(name, "not recorded"), b.updated_at]
                  for name, b in facts["beats"]]
    retries = [[r["attempt"], r["complete"], ",".join(r.get("kinds", [])), " ".join(r.get("overrides", [])),
                r.get("rows")] for r in facts["retries"]]
    return [
        "<h2>Shards</h2>" + _table(["status file", "state", "rows done", "error rows (the job's runs, before "
                                    "retries)", "generated tokens", "throughput (its last run, after load)",
                                    "updated"], shard_rows),
        "<h2>Workers</h2>" + _table(["worker (host:pid or Ray worker)", "parts", "rows", "generated tokens"],
                                    [[k, int(v["parts"]), int(v["rows"]), int(v["tokens"])]
                                     for k, v in sorted(workers.items())]),
        "<h2>Retries</h2>" + (_table(["attempt", "complete", "kinds", "overrides", "rows"], retries) if retries
                              else "<p>none</p>"),
    ]


def write_report(output_dir: Path, out: Optional[Path] = None) -> Path:
    from batchgen.fsutil import write_bytes_atomic

    path = out or output_dir / REPORT
    page = redact_text(render(output_dir, gather(output_dir)))  # an error row written before redaction, a secret
    write_bytes_atomic(path, page.encode("utf-8"))  # this process remembers
    return path


def write_remote_report(url: str, out: Optional[Path]) -> Path:
    """The page of an output on object storage, from a local copy of what the report reads, written to `out`."""
    from batchgen.commands.status import fetch_remote
    from batchgen.fsutil import write_bytes_atomic

    if out is None:
        raise ConfigError([f"{url} is on object storage: pass --out FILE for the page (batchgen writes nothing into "
                           f"an output's bucket but the job's own files)"])
    with tempfile.TemporaryDirectory(prefix="batchgen-report-") as tmp:
        local = Path(tmp)
        remote = fetch_remote(url, local)
        if remote is None:
            raise ConfigError([f"{url}: no batchgen output here (no {MANIFEST})"])
        for path in remote.staging.glob(HISTORY_GLOB):  # the history stays in the staging directory of its machine
            shutil.copyfile(path, local / path.name)
        _copy_row_columns(remote, local)
        page = render(remote.url, gather(local))
    write_bytes_atomic(out, page.encode("utf-8"))
    return out


def _copy_row_columns(remote: RemoteOutput, into: Path) -> None:
    """Each committed part under its own name in `into`, checked as every reader checks a part (parts.open_part), with
    its ROW_COLUMNS read and the committer's other columns (the generations) left null: the page counts rows and
    errors, and a night's generations are not downloaded for that."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.output.parts import open_part
    from batchgen.output.rows.schema import OUTPUT_COLUMNS, PART_RE

    for key in remote.fs.ls(remote.root, detail=False, refresh=True):
        name = key.rsplit("/", 1)[-1]
        if PART_RE.match(name):
            with remote.fs.open(key, "rb") as f:
                part = open_part(f"{remote.url.rstrip('/')}/{name}", source=f)
                read, schema = part.read(columns=list(ROW_COLUMNS)), part.schema_arrow
                arrays = [read.column(c) if c in ROW_COLUMNS else pa.nulls(read.num_rows, schema.field(c).type)
                          for c in OUTPUT_COLUMNS]
                pq.write_table(pa.Table.from_arrays(arrays, names=list(OUTPUT_COLUMNS)), into / name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchgen report", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a directory, or an fsspec URL (s3://bucket/prefix)")
    parser.add_argument("--out", type=Path, help=f"the page's path (default OUTPUT_DIR/{REPORT}; required for an "
                                                 f"output on object storage)")
    args = parser.parse_args(argv)
    where = args.output_dir
    try:
        path = write_remote_report(where, args.out) if is_remote(where) else write_report(Path(where), args.out)
    except ConfigError as exc:  # no manifest, or a torn one: named, exit 2
        for problem in exc.problems:
            print(f"batchgen report: error: {problem}", file=sys.stderr)
        return 2
    except (BadPartError, FileNotFoundError) as exc:  # a part that is not batchgen's: named, exit 2
        print(f"batchgen report: error: {exc}", file=sys.stderr)
        return 2
    print(f"batchgen report: {path}")
    return 0
