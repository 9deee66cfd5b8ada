"""`batchgen retry OUTPUT_DIR [--kinds too_long,invalid_output] [key=value ...]`: generate again the rows of a
finished job that erred with a retryable kind, under the job's own config plus the overrides given (a larger
engine.max_model_len, run.too_long=truncate_left, another sampling.seed...).

Each retry is an attempt: attempt N writes `OUTPUT_DIR/_attempts/attempt-NNN/`, a job of its own (manifest, journals,
parts, _SUCCESS, so resumable and exactly-once like any job), whose input is `_input.parquet` there: the erring rows
of the job's input, read once, with their original ids and which row of their id each is (view.OCCURRENCE: ids
may repeat). Its parts carry an `attempt` column and that occurrence. Once complete, it is published
(output/publish.py): the top-level parts show the latest attempt per row, the job's own kept in _attempts/original/.
A retry killed at any point (publishing included) is finished by the same command again, or `batchgen retry
OUTPUT_DIR` alone (the unfinished attempt's recorded kinds and overrides); a new attempt starts only once the last
is complete. Knows the output layout and the job runner; the config comes from the CLI (`config_from`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.commands.terminal import error_text, escape_console, lines, one_line
from batchgen.errors import BatchgenError, ConfigError, LockedError
from batchgen.fsutil import replace_durably, write_json_atomic
from batchgen.job import JobConfig
from batchgen.output.lock import is_held, lock_name
from batchgen.output.manifest import MANIFEST, diff, read_manifest, refuse_quoted
from batchgen.output.parts import part_schema
from batchgen.output.publish import pending, publish, published_line, reading_line
from batchgen.output.remote import is_remote
from batchgen.output.rows.schema import ATTEMPT_FIELD, OPTIONAL_FIELDS, OUTPUT_COLUMNS, SUCCESS
from batchgen.output.rows.stats import error_kind
from batchgen.output.view import OCCURRENCE, attempt_dir, attempts, keyed_batches, latest_batches, part_files
from batchgen.redact import MASK

log = logging.getLogger(__name__)

DEFAULT_KINDS = ("too_long", "invalid_output", "endpoint_rejected", "endpoint_finish", "endpoint_failed")
# kinds a retry can mend with other settings; the reader's own (malformed_json, invalid_utf8, too_large, too_deep,
# bad_value, unreadable) need the input fixed, and a row of theirs reads the same again
RETRYABLE = ("too_long", "invalid_output", "empty_prompt", "non_string_prompt", "bad_template", "bad_messages",
             "bad_max_new_tokens", "bad_temperature", "bad_stop", "bad_choice", "bad_schema",
             "endpoint_rejected", "endpoint_finish", "endpoint_failed")  # engine=openai: refused, cut, kept failing
RETRY_FILE = "_retry.json"  # the attempt's kinds and overrides, written once its input is ready
INPUT_FILE = "_input.parquet"  # the attempt's input rows ('_': no reader of the output's parts picks it up)
ID_COLUMN = "_batchgen_id"  # the original row id, the retry's dataset.id_column
SET_BY_RETRY = ("output_dir", "dataset.path", "dataset.format", "dataset.limit", "dataset.id_column",
                "run.attempt", "run.shard", "run.num_shards", "run.skip_existing", "run.resume")
# keys that change how many samples a row has: the view replaces a row's samples one for one, so another count would
# drop the retry's extra samples from latest() (or keep the old ones past its count) where duckdb_sql does otherwise
SAMPLE_COUNT_KEYS = ("sampling.n", "dataset.n_column")


def _finished_manifest(output_dir: Path) -> dict[str, Any]:
    """The manifest of a complete output that recorded its job's config; else a ConfigError saying what to do."""
    manifest = read_manifest(output_dir)  # a torn one is a ConfigError naming it
    if manifest is None:
        raise ConfigError([f"{output_dir}: no batchgen output here (no {MANIFEST})"])
    if not (output_dir / SUCCESS).exists():
        raise ConfigError([f"{output_dir} is not complete (no {SUCCESS}): rerun its job to finish it first, then "
                           f"retry (batchgen status {output_dir} tells what is left)"])
    if not manifest.get("config"):
        raise ConfigError([f"{output_dir}/{MANIFEST} records no config (a job run from Python without `resolved`); "
                           f"retry needs the job's config"])
    return manifest


def prepare(output_dir: Path, kinds: Optional[list[str]], overrides: list[str],
            config_from: Callable[[dict[str, Any], list[str]], JobConfig]) -> Optional[tuple[JobConfig, dict]]:
    """The retry job to run (its config and resolved dict), or None when no row erred with these kinds."""
    manifest = _finished_manifest(output_dir)
    refuse_quoted(output_dir, manifest, "retry")  # an attempt's parts are the view's rows beside the output's
    original = manifest["config"]
    refused = _refused(overrides) + _code_named(original, overrides, output_dir) + _masked(original, overrides,
                                                                                          output_dir)
    unknown = [k for k in kinds or () if k not in RETRYABLE]
    if unknown:
        refused.append(f"--kinds: {', '.join(unknown)} cannot be retried (retryable kinds: {', '.join(RETRYABLE)}; "
                       f"the reader's own errors need the input fixed)")
    if refused:
        raise ConfigError(refused)
    last = attempts(output_dir)[-1]
    recorded = _recorded(output_dir, last) if last else None
    unfinished = last and not (attempt_dir(output_dir, last) / SUCCESS).exists() and recorded is not None
    if unfinished and _resumes(output_dir, last, recorded, kinds, overrides):  # type: ignore[arg-type]
        print(f"finishing the unfinished attempt {last} with its recorded kinds and overrides")
        return _job(output_dir, last, recorded["overrides"], manifest, config_from)  # type: ignore[index]
    attempt = last if last and (recorded is None or unfinished) else last + 1  # never completed, or replaced: anew
    kinds = list(kinds or DEFAULT_KINDS)
    base = config_from(original, [])
    failed = failed_rows(output_dir, kinds)
    if not failed:
        return None
    config_from(original, overrides)  # a bad override refused before anything is written
    here = attempt_dir(output_dir, attempt)
    if unfinished:
        _replace(here, recorded)  # type: ignore[arg-type]
    here.mkdir(parents=True, exist_ok=True)
    rows = write_input(base, manifest, failed, here / INPUT_FILE)
    write_json_atomic(here / RETRY_FILE, {"attempt": attempt, "kinds": kinds, "overrides": overrides,
                                          "ids": len(failed), "rows": rows})
    print(one_line(f"attempt {attempt}: retrying {rows} rows that erred with {', '.join(kinds)}, in {here}"))
    return _job(output_dir, attempt, overrides, manifest, config_from)


def _resumes(output_dir: Path, last: int, recorded: dict[str, Any], kinds: Optional[list[str]],
             overrides: list[str]) -> bool:
    """Whether the unfinished last attempt is resumed (no kinds or overrides asked, or its own), else replaced: one
    that committed no part holds no answer yet (a run that failed before its first commit, a half-written one), so
    a retry with other settings takes its place. One that committed parts is finished first (its rows are answers
    in the view already); one a live retry runs is left to it."""
    here = attempt_dir(output_dir, last)
    if is_held(here / lock_name(0, 1)):
        raise LockedError(f"{here} is being run by another batchgen retry; wait for it to finish, or stop it")
    asked = {"kinds": list(kinds or DEFAULT_KINDS), "overrides": overrides}
    if (kinds is None and not overrides) or asked == {k: recorded[k] for k in asked}:
        return True
    if not part_files(here):
        return False
    started = " ".join(["batchgen retry", str(output_dir), "--kinds", ",".join(recorded["kinds"]),
                        *recorded["overrides"]])
    raise ConfigError([f"{here} is an unfinished retry started as `{started}` that committed "
                       f"{len(part_files(here))} parts: run that (or `batchgen retry {output_dir}` alone) to finish "
                       f"it first"])


def _replace(here: Path, recorded: dict[str, Any]) -> None:
    """Remove an unfinished attempt that committed no part (_resumes), so that a new one starts in its place."""
    log.warning("%s: an unfinished retry (kinds %s, overrides %s) that committed no part; replaced by this one",
                here, ",".join(recorded["kinds"]), " ".join(recorded["overrides"]) or "none")
    shutil.rmtree(here)


def _refused(overrides: list[str]) -> list[str]:
    """The overrides a retry cannot take, one problem each: the keys it sets itself, and those that change the
    samples per row; a whole group (`sampling={...}`) is refused where it may set one of them."""
    problems = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        for keys, why in ((SET_BY_RETRY, "set by batchgen retry (the attempt's own input and output)"),
                          (SAMPLE_COUNT_KEYS, "the samples per row, which a retry keeps (the latest-attempt view "
                                              "replaces a row's samples one for one)")):
            hit = _under(key, keys)
            if hit == [key]:
                problems.append(f"{key}: {why}; leave it out" + (", or run a new job for another count"
                                                                  if keys is SAMPLE_COUNT_KEYS else ""))
            elif hit:
                problems.append(f"{key}: a whole group may set {', '.join(hit)}: {why}; override the keys under it "
                                f"one by one")
            if hit:
                break
    return problems


def _code_named(original: dict[str, Any], overrides: list[str], output_dir: Path) -> list[str]:
    """The recorded settings that would make the retry run code a file names (a model directory's own Python with
    engine.trust_remote_code, a class pyiceberg imports for output.catalog.*-impl), unless the retry's command line
    says them again: an output directory is data (one copied from a colleague or a bucket may carry any manifest), so
    its manifest alone never turns code on."""
    said = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    engine, output = original.get("engine") or {}, original.get("output") or {}
    catalog = output.get("catalog") if isinstance(output.get("catalog"), dict) else {}
    named = [("engine.trust_remote_code", "true")] if engine.get("trust_remote_code") is True else []
    named += [(f"output.catalog.{k}", str(v)) for k, v in sorted(catalog.items()) if str(k).endswith("impl")]
    return [f"{output_dir}/{MANIFEST} records {key}={value}: batchgen retry runs no code because an output's manifest "
            f"names it; if you trust it, say it again: batchgen retry {output_dir} {key}={value}"
            for key, value in named if key not in said]


def _masked(original: dict[str, Any], overrides: list[str], output_dir: Path) -> list[str]:
    """The recorded settings whose credential the manifest holds masked (a URL's user, password or query value, a
    secret-named value: batchgen.redact), unless the retry's command line gives them again: sent as recorded, the
    mask itself would go to the server as the credential."""
    said = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    masked = [key for key, value in _leaves(original, "") if isinstance(value, str)
              and (value == MASK or "://" in value and MASK in value)
              and not any(key == s or key.startswith(s + ".") for s in said)]
    return [f"{output_dir}/{MANIFEST} records {key} with its credential masked ({MASK}), as batchgen never stores "
            f"one: a retry would send {MASK} in its place. Give it again: batchgen retry {output_dir} {key}=..."
            + (" (or leave the credential out of the URL and name the variable that holds the key: "
               "engine.api_key_env=VAR)" if key == "engine.base_url" else "") for key in masked]


def _leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value under a config mapping."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _under(key: str, keys: tuple[str, ...]) -> list[str]:
    """Those of `keys` that overriding `key` sets: itself, or all under a group."""
    return [k for k in keys if k == key or k.startswith(key + ".")]


def _recorded(output_dir: Path, attempt: int) -> Optional[dict[str, Any]]:
    path = attempt_dir(output_dir, attempt) / RETRY_FILE
    return json.loads(path.read_text()) if path.exists() else None


def failed_rows(output_dir: Path, kinds: list[str]) -> dict[str, set[int]]:
    """Per id, its rows (occurrences: 0-based, in the job's output order; ids may repeat) with a sample whose latest
    attempt erred with one of `kinds`. Two passes over the view's id and error: the erring ids, then their rows'
    occurrences, counted for those ids alone (memory stays with the erring rows)."""
    ids = {values[0] for values in _erring(latest_batches(output_dir, columns=["id", "error"]), kinds)}
    out: dict[str, set[int]] = {}
    if ids:
        for row_id, _, occurrence in _erring(keyed_batches(output_dir, ["id", "error"], ids), kinds):
            out.setdefault(row_id, set()).add(occurrence)
    return out


def _erring(tables: Iterator[pa.Table], kinds: list[str]) -> Iterator[tuple]:
    """The values of each row (columns id, error, ...) that erred with one of `kinds`."""
    for table in tables:
        for values in zip(*(column.to_pylist() for column in table.columns)):
            if values[1] is not None and error_kind(values[1]) in kinds:
                yield values


def write_input(cfg: JobConfig, manifest: dict[str, Any], failed: dict[str, set[int]], path: Path) -> int:
    """The job's input rows in `failed` (id and occurrence), streamed from the job's own input (refused if it changed
    since), with each row's original id in ID_COLUMN and its occurrence in OCCURRENCE (the view matches the retry's
    rows to the job's by both); written under a temp name, then renamed."""
    from batchgen.reader import open_reader

    reader = open_reader(cfg.dataset)
    _refuse_own_names(reader.columns() or [], cfg.dataset.path)
    changes = diff({"input": manifest.get("input")}, {"input": json.loads(json.dumps(reader.fingerprint()))})
    if changes:
        raise ConfigError([f"the job's input changed since it ran ({'; '.join(changes[:3])}); a retry reads the "
                           f"rows it retries from that input: restore it, or run a new job"])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer: Optional[pq.ParquetWriter] = None
    rows, seen = 0, {}
    try:
        for batch in reader.iter_batches():
            keep, occurrences = _pick(batch, failed, seen)
            if not keep:
                continue
            table = batch.table.take(pa.array(keep, pa.int64()))
            table = table.append_column(pa.field(ID_COLUMN, pa.string()), pa.array([batch.ids[i] for i in keep]))
            table = table.append_column(pa.field(OCCURRENCE, pa.int64()), pa.array(occurrences, pa.int64()))
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table.cast(writer.schema))
            rows += len(keep)
        if writer is not None:
            writer.close()
            writer = None
            replace_durably(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)
    if not rows:
        raise ConfigError([f"none of the {len(failed)} erring ids was found in the job's input {cfg.dataset.path}"])
    return rows


def _refuse_own_names(columns: list[str], path: str) -> None:
    """An input column named as a retry's hidden ones (refused at a job's start since: an output from before)."""
    taken = [c for c in columns if c in (ID_COLUMN, OCCURRENCE)]
    if taken:
        raise ConfigError([f"the job's input {path} has a column {', '.join(map(repr, taken))}, a name batchgen "
                           f"retry gives its own hidden columns: rename it in the input and run the job again"])


def _pick(batch: Any, failed: dict[str, set[int]], seen: dict[str, int]) -> tuple[list[int], list[int]]:
    """The batch's rows to retry and their occurrences. Every input row is an output row in the same order (a read
    error too), so counting the erring ids' rows here gives the view's occurrences; `seen` carries the counts."""
    keep, occurrences = [], []
    for i, (row_id, err) in enumerate(zip(batch.ids, batch.read_errors)):
        if row_id not in failed:
            continue
        occurrence = seen[row_id] = seen.get(row_id, -1) + 1
        if occurrence in failed[row_id] and err is None:
            keep.append(i)
            occurrences.append(occurrence)
    return keep, occurrences


def _job(output_dir: Path, attempt: int, overrides: list[str], manifest: dict[str, Any],
         config_from: Callable[[dict[str, Any], list[str]], JobConfig]) -> tuple[JobConfig, dict]:
    """The attempt's job: the original config, its input and output the attempt's, then the overrides."""
    here = attempt_dir(output_dir, attempt)
    resolved = json.loads(json.dumps(manifest["config"]))
    dataset, run = resolved.setdefault("dataset", {}), resolved.setdefault("run", {})
    if dataset.get("format") == "openai_batch":  # its columns as the job resolved them (reader/openai_batch.py)
        used = (manifest.get("output_config") or {}).get("dataset") or {}
        dataset.update({k: v for k, v in used.items() if k.endswith("_column") and v is not None})
    # the rows' occurrences go through to the attempt's parts (none in an input written before they were recorded)
    names = pq.read_schema(here / INPUT_FILE).names
    hidden = [OCCURRENCE] if OCCURRENCE in names else []
    dataset.update(path=str(here / INPUT_FILE), format="parquet", limit=None, id_column=ID_COLUMN,
                   passthrough_columns=[c for c in passthrough_of(output_dir, manifest) if c in names] + hidden)
    run.update(attempt=attempt, resume=True, shard=0, num_shards=1, skip_existing=None)
    resolved["output_dir"] = str(here)
    cfg = config_from(resolved, overrides)
    return cfg, resolved | {"retry": {"of": str(output_dir), "attempt": attempt, "overrides": overrides}}


def passthrough_of(output_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """The passthrough columns the job wrote: as its manifest recorded them, else its first part's columns past the
    output's own (_job keeps those of the input: task=decide's question columns and needs_review are not)."""
    if isinstance(manifest.get("passthrough"), list):
        return [str(name) for name in manifest["passthrough"]]
    own = {*OUTPUT_COLUMNS, *OPTIONAL_FIELDS, ATTEMPT_FIELD.name}
    parts = part_files(output_dir)
    return [name for name in part_schema(parts[0]).names if name not in own] if parts else []


def _local_dir(text: str) -> Path:
    """The output directory: local (an object store cannot rename a part over another atomically)."""
    if is_remote(text):
        raise argparse.ArgumentTypeError(f"{text}: retry works on a local output_dir: copy it here, retry, copy back")
    return Path(text)


def _finish(output_dir: Path, attempt: int) -> int:
    """After a complete attempt: publish it (output/publish.py), then the job's OpenAI results file from the latest
    attempts. 0, or 1 where a write failed (a rerun of `batchgen retry OUTPUT_DIR` publishes again)."""
    from batchgen.output.openai_out import write_if_wanted

    try:
        print(one_line(published_line(output_dir, publish(output_dir, attempt))))
    except OSError as exc:
        print(f"batchgen retry: error: publishing attempt {attempt} over {output_dir}'s parts failed ({exc}); every "
              f"row is still there once: rerun `batchgen retry {output_dir}` to finish it", file=sys.stderr)
        return 1
    if written := write_if_wanted(output_dir):  # the job's results file, now from the latest attempts
        print(f"OpenAI batch results rewritten from the latest attempts: {written}")
    print(one_line(reading_line(output_dir)))
    return 0


def main(argv: list[str], config_from: Callable[[dict[str, Any], list[str]], JobConfig]) -> int:
    """The CLI's `batchgen retry`; `config_from` (cli.py, the one module that knows Hydra) builds the config."""
    from batchgen.run.runner import run_job
    from batchgen.run.stopping import StopRequested

    parser = argparse.ArgumentParser(prog="batchgen retry", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=_local_dir)
    parser.add_argument("--kinds", help=f"error kinds to retry, comma-separated (default {','.join(DEFAULT_KINDS)})")
    parser.add_argument("-v", "--verbose", action="store_true", help="the run's INFO log lines on the console too")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides for the retried rows")
    args = parser.parse_intermixed_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,  # plain lines on the console
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s" if args.verbose
                        else "batchgen retry: %(levelname)s: %(message)s")
    escape_console(logging.getLogger())  # a warning may quote a row's id: escaped
    try:
        if (unpublished := pending(args.output_dir)) is not None:  # a retry killed while it published: finish that
            return _finish(args.output_dir, unpublished)
        job = prepare(args.output_dir, kinds, args.overrides, config_from)
        if job is None:
            print(f"batchgen retry: no row of {args.output_dir} erred with {', '.join(kinds or DEFAULT_KINDS)}; "
                  f"nothing to retry")
            return 0
        summary = run_job(*job)
    except BatchgenError as exc:
        print(f"batchgen retry: error: {error_text(exc)}", file=sys.stderr)  # may quote a row: escaped
        return exc.exit_code
    except StopRequested as exc:
        print(f"batchgen retry: {exc}; rerun the same command to finish this attempt", file=sys.stderr)
        return exc.exit_code
    print(lines(summary.render()))
    return _finish(args.output_dir, job[1]["retry"]["attempt"]) if summary.state == "done" else 0
