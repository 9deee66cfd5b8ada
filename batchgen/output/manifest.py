"""The manifest: what a run's output was made from, so that a resume can refuse a different input,
model or output-affecting config (docs/contract.md section 6, rule 3). Knows files and dicts, not models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path
from typing import Any, Optional

from batchgen.engines import seeded_draw
from batchgen.engines.base import WEIGHT_FILES
from batchgen.errors import ConfigError, ResumeMismatchError
from batchgen.fsutil import content_digest, file_sha256, write_json_atomic
from batchgen.job import JobConfig
from batchgen.output.prompt_files import prompt_identity
from batchgen.redact import redact
from batchgen.version import __version__

log = logging.getLogger(__name__)
MANIFEST = "_manifest.json"


def read_manifest(output_dir: Path | str) -> Optional[dict[str, Any]]:
    """output_dir's manifest, None where there is none; a manifest that is not a JSON object (torn by a crash of
    a batchgen before atomic writes, or edited by hand) is a ConfigError (exit 2) naming the file."""
    path = Path(output_dir) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"{path}: cannot read the manifest ({exc}); restore it or write to a new output_dir"
        raise ConfigError([problem]) from exc
    return parse_manifest(text, str(path))


def parse_manifest(text: str | bytes, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        manifest, reason = None, f"not valid JSON ({exc})"
    else:
        reason = "not a JSON object"
    if not isinstance(manifest, dict):
        raise ConfigError([f"{where}: the manifest is {reason}: it was torn or edited. Restore it from a backup, "
                           f"or write to a new output_dir (the parts there are kept as they are)"])
    return manifest


def output_config(cfg: JobConfig) -> dict[str, Any]:
    """The config keys that change what is written; batch sizes, sharding and policies do not. The requested
    engine.dtype is not among them: what it resolves to is (ENGINE_KEYS, compared once the engine is loaded), so
    `bfloat16` and an `auto` that resolves to bf16 are the same run, and an `auto` that resolves otherwise is not.
    Local paths (dataset, model, tokenizer) are compared resolved: a symlink or a relative path to the same file or
    directory is the same run."""
    engine = cfg.engine
    return {
        "dataset": _dataset(cfg),
        "sampling": _sampling(cfg),
        "engine": {"name": engine.name, "model": _local(engine.model), "tokenizer": _local(engine.tokenizer),
                   "quantization": engine.quantization, "max_model_len": engine.max_model_len,
                   **_endpoint(engine),
                   **seeded_draw(engine.name, not cfg.sampling.greedy or cfg.dataset.temperature_column is not None)},
        **_output(cfg),
        **({"task": cfg.task} if cfg.task != "generate" else {}),
        **({"embed": dataclasses.asdict(cfg.embed)} if cfg.task == "embed" else {}),
        **({"decide": dataclasses.asdict(cfg.escaped().decide)} if cfg.task == "decide" else {}),
        "run": {"rows_per_part": cfg.rows_per_part, "too_long": cfg.run.too_long,
                **({"skip_existing": _skipped(cfg)} if cfg.run.skip_existing else {}),
                **({"attempt": cfg.run.attempt} if cfg.run.attempt else {})},
    }


def _output(cfg: JobConfig) -> dict[str, Any]:
    """output.usage, output.prices and output.include_prompt add columns, a table sink writes elsewhere: in the hash
    where set (an output written before them keeps its). A table is its name and its catalog's (credentials are
    neither). `parsed: plain`: a choice's, regex's or grammar's `parsed` is its text, choice_scores a map."""
    out, s = cfg.output, cfg.sampling
    plain = bool(cfg.dataset.choice_column) or any(getattr(s, k) not in (None, "", []) for k in PLAIN_KINDS)
    table = {"sink": out.sink, "table": out.table, "mode": out.mode,
             **({"catalog": {k: out.catalog.get(k) for k in ("type", "uri", "warehouse")}} if out.catalog else {})}
    extra = {**({"usage": True} if out.usage else {}), **({"include_prompt": True} if out.include_prompt else {}),
             **({"prices": dataclasses.asdict(out.prices)} if out.priced() is not None else {}),
             **(table if out.sink != "parquet" else {}), **({"parsed": "plain"} if plain else {})}
    return {"output": extra} if extra else {}


PLAIN_KINDS = ("choice", "regex", "grammar")  # whose `parsed` is the text itself, choice_scores a map (before: JSON)


def refuse_quoted(output_dir: Any, manifest: dict[str, Any], doing: str) -> None:
    """Refuse to add to an output written before `output.parsed: plain` was recorded, whose `parsed` holds a choice,
    regex or grammar value as JSON text ('"positive"'), choice_scores a list of {choice, score}: never both forms."""
    old = manifest.get("output_config") or {}
    sampling, version = old.get("sampling") or {}, manifest.get("batchgen_version")
    if (old.get("output") or {}).get("parsed") or not ((old.get("dataset") or {}).get("choice_column") or any(
            sampling.get(k) not in (None, "", []) for k in PLAIN_KINDS)):
        return
    raise ResumeMismatchError(
        f"{output_dir} was started by batchgen {version}, whose `parsed` holds a choice, regex or grammar value as "
        f"JSON text ('\"positive\"') and `choice_scores` a list of {{choice, score}}; this batchgen writes the value "
        f"itself (positive) and a map of label to score, and one output never holds both: {doing} it with the "
        f"batchgen install that started it, or write to a new output_dir (output_dir=NEW_DIR on the command line).")


def _endpoint(engine: Any) -> dict[str, Any]:
    """engine=openai's keys that change what the server generates (where it is, the key, its concurrency do not)."""
    if engine.name != "openai":
        return {}
    return {"endpoint": engine.endpoint, "extensions": engine.extensions, "extra_body": dict(engine.extra_body)}


# sampling keys added after the first release: left out of the hash at their defaults, so that an output written
# before they existed resumes under the same hash
LATER_SAMPLING_KEYS = ("json_schema", "regex", "choice", "grammar", "choice_scores", "schemas", "logprobs",
                       "reasoning", "reasoning_start", "reasoning_end", "max_reasoning_tokens", "num_beams",
                       "length_penalty", "early_stopping", "repetition_penalty", "presence_penalty",
                       "frequency_penalty", "min_p", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids",
                       "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
                       "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs")
LATER_DATASET_KEYS = ("temperature_column", "stop_column", "choice_column", "schema_column", "top_p_column",
                      "seed_column", "n_column", "response_format_column", "text_column", "repetition_penalty_column",
                      "presence_penalty_column", "frequency_penalty_column", "min_p_column", "min_tokens_column",
                      "logit_bias_column", "chat_template", "bad_words_column", "allowed_token_ids_column",
                      "stop_token_ids_column")


def _sampling(cfg: JobConfig) -> dict[str, Any]:
    """sampling.* as compared: a constraint by its content (a schema file's JSON, not its path)."""
    out = dataclasses.asdict(cfg.sampling)
    defaults = dataclasses.asdict(type(cfg.sampling)())
    for key in LATER_SAMPLING_KEYS:
        if out[key] == defaults[key]:
            del out[key]
    constraint = cfg.sampling.constraint()
    if constraint is not None:
        out[constraint.kind] = constraint.spec
    if cfg.sampling.schemas:
        out["schemas"] = {name: c.spec for name, c in cfg.sampling.named_schemas().items()}
    return out


def _dataset(cfg: JobConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg.dataset) | {"batch_rows": None, "path": _input(cfg.dataset.path)}
    del out["render_timeout_s"]  # a limit, not what a prompt is: a retry may raise it for the rows it cost
    for key in LATER_DATASET_KEYS:
        if out[key] is None:
            del out[key]
    if not out["chat_template_kwargs"]:
        del out["chat_template_kwargs"]
    if cfg.dataset.chat_template is not None:  # a template file by its text: an edited file is another run
        from batchgen.prompts.render import chat_template_text

        out["chat_template"] = chat_template_text(cfg.dataset.chat_template)
    # the template and the system prompt compared as written before validate made their newlines (texts.py), so
    # that an output made since `\n` meant a newline in them resumes under the same hash
    written = cfg.escaped().dataset
    out["template"], out["system_prompt"] = written.template, written.system_prompt
    if any(re.search(r"\\[nt\\]", text or "") for text in (written.template, written.system_prompt)):
        out["text_escapes"] = True  # \n in them is a newline: an output made before that differs
    return out


def _local(path: Optional[str]) -> Optional[str]:
    return os.path.realpath(path) if path and os.path.isdir(path) else path


NIGHTS_BESIDE = ".."  # run.skip_existing as recorded when it names the folder holding output_dir (section below)


def nights_beside(skip_existing: str, output_dir: str) -> bool:
    """Whether run.skip_existing names the folder that holds output_dir: the nights of a `batchgen increment` root,
    every finished one of which counts (output/ledger/existing.py)."""
    if "://" in skip_existing or "://" in output_dir:
        return False
    return os.path.realpath(skip_existing) == os.path.realpath(os.path.dirname(os.path.abspath(output_dir)))


def _skipped(cfg: JobConfig) -> str:
    """run.skip_existing as compared: the nights beside the output as NIGHTS_BESIDE, so that a root of nights moved
    elsewhere (another disk, another mount point) resumes its night under the same config; any other path as a
    dataset path is."""
    if nights_beside(cfg.run.skip_existing, str(cfg.output_dir)):
        return NIGHTS_BESIDE
    return _input(cfg.run.skip_existing)


def _input(path: str) -> str:
    """dataset.path as compared: an existing local file or directory resolved, a local glob made absolute; a URL
    or a hub id as given."""
    if "://" in path:
        return path
    if os.path.exists(path):
        return os.path.realpath(path)
    return os.path.abspath(path) if any(ch in path for ch in "*?[") else path


# What a loaded engine reports (Engine.identity()) that changes its outputs: compared on resume. The device and
# the linear layout are not (the same dtype's arithmetic on another device or layout); an endpoint's served model
# (what its /v1/models says: id, root, max_model_len) is.
ENGINE_KEYS = ("engine", "dtype", "activations", "quantization", "quantization_scheme")
ENDPOINT_KEYS = ("served_model",)  # recorded only where the engine reports them (engine=openai)


def config_hash(cfg: JobConfig) -> str:
    compared = redact(output_config(cfg))  # a rotated key in a URL is the same run
    return hashlib.sha256(json.dumps(compared, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: str, tokenizer: Optional[str] = None) -> dict[str, Any]:
    """A local model by content: its directory (symlinks and relative paths resolved), config.json's digest, and
    per weight file its size, its safetensors header's digest, a sampled content digest (fsutil.content_digest) and
    the whole file's sha256 (fsutil.file_sha256, read once per version of the file). Retrained weights copied over
    the same files are a different model, a few tensors rewritten in place included; the same bytes under another
    path spelling are the same. The files that shape a prompt are in it too (prompt_identity: `tokenizer`, the
    engine.tokenizer directory where it is another). A hub id stands for itself."""
    path = Path(model)
    if not path.is_dir():
        return {"model": model, **prompt_identity(model, tokenizer)}
    config = path / "config.json"
    weights = []
    for file in sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_FILES)):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header = _safetensors_header(f) if file.suffix == ".safetensors" else None
            f.seek(0)
            weights.append({"file": file.name, "size": size, "header_sha256": header,
                            "digest": content_digest(f, size), "sha256": file_sha256(file)})
    return {
        "model": os.path.realpath(model),
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.exists() else None,
        "weights": weights,
        **prompt_identity(model, tokenizer),
    }


def _safetensors_header(f: Any) -> Optional[str]:
    """sha256 of a safetensors file's JSON header (tensor names, dtypes, shapes, offsets); None if unreadable."""
    head = f.read(8)
    if len(head) < 8:
        return None
    length = int.from_bytes(head, "little")
    if length > 100 << 20:
        return None
    return hashlib.sha256(f.read(length)).hexdigest()[:16]


def build_manifest(cfg: JobConfig, resolved: dict[str, Any], fingerprint: list[dict],
                   input_rows: Optional[int] = None, passthrough: Optional[list[str]] = None) -> dict[str, Any]:
    """`input_rows` (after dataset.limit) with `rows_per_part` fix how many parts the output has: what `batchgen
    finalize` checks every shard's parts against. `passthrough`: the input columns every part carries, recorded so
    that a resume writes the columns the output was started with (prepare.kept_passthrough), whatever a later
    batchgen's default; not compared (the input and dataset.* that decide them are)."""
    parts = None if input_rows is None else max(-(-input_rows // cfg.rows_per_part), 1)  # an empty input: 1 part
    return redact({  # a URL's user, password and query values (a gateway's key, a catalog's password) never kept
        "batchgen_version": __version__,
        "config_hash": config_hash(cfg),
        "output_config": json.loads(json.dumps(output_config(cfg), default=str)),
        "input": fingerprint,
        "model": model_identity(cfg.engine.model, cfg.engine.tokenizer),
        "config": resolved,
        "input_rows": input_rows,
        "parts": parts,
        **({"passthrough": passthrough} if passthrough is not None else {}),
    })


def check_or_write(output_dir: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest for a new run; for a resume, refuse unless input, model and config all match."""
    path = output_dir / MANIFEST
    old = read_manifest(output_dir)  # a torn one: exit 2 naming it
    if old is None:
        write_json_atomic(path, manifest)
        return
    refuse_quoted(output_dir, old, "resume")
    changes = diff(old, manifest)
    if changes:
        lines = "\n".join(f"  {c}" for c in changes)
        raise ResumeMismatchError(
            f"{output_dir} holds a run made from a different input, model or config:\n{lines}\n"
            f"Resume with the original settings, or write to a new output_dir (output_dir=... or name=...).",
            changes=tuple(changes),
        )


def record_layout(output_dir: Path, num_shards: int) -> None:
    """Record run.num_shards in the manifest. No live writer of another layout exists here (lock.OutputLock checked
    that); a new layout after all writers of the old one have stopped is taken over, logged: parts are the same
    whatever the sharding, only their assignment to shards changes. Call with the layout lock held."""
    path = output_dir / MANIFEST
    manifest = read_manifest(output_dir) or {}
    old = manifest.get("layout", {}).get("num_shards")
    if old == num_shards:
        return
    if old is not None:
        log.warning("%s was written with run.num_shards=%s and no writer of it is live; continuing with "
                    "run.num_shards=%s (committed parts are kept whatever the sharding)", output_dir, old, num_shards)
    write_json_atomic(path, manifest | {"layout": {"num_shards": num_shards}})


def job_id(output_dir: Path) -> str:
    """The output's own identity, made once (a random id in the manifest) and kept by every resume, shard, Ray worker
    and machine that writes it: what a table output's transactions are named by (output/tables/). Call with the
    layout lock held."""
    manifest = read_manifest(output_dir) or {}
    if not manifest.get("job_id"):
        manifest["job_id"] = uuid.uuid4().hex
        write_json_atomic(output_dir / MANIFEST, manifest)
    return manifest["job_id"]


def check_engine(output_dir: Path, identity: dict[str, Any]) -> None:
    """Record the loaded engine's resolved settings (ENGINE_KEYS) in the manifest on the first run; on a resume,
    refuse an engine whose settings resolved otherwise (engine.dtype=auto on another CPU kind, another
    quantization) before any part is generated. Call with the output directory's layout lock held."""
    path = output_dir / MANIFEST
    manifest = read_manifest(output_dir) or {}
    resolved = {k: identity.get(k) for k in ENGINE_KEYS} | {k: identity[k] for k in ENDPOINT_KEYS if k in identity}
    recorded = manifest.get("engine_resolved")
    if recorded is None:
        write_json_atomic(path, manifest | {"engine_resolved": resolved})
        return
    changes = _diff(recorded, resolved, "engine")
    if changes:
        lines = "\n".join(f"  {c}" for c in changes)
        hint = f"Set them explicitly to the recorded values (e.g. engine.dtype={recorded.get('dtype')}) to resume"
        if recorded.get("quantization_scheme") != resolved.get("quantization_scheme"):
            hint = _scheme_hint(recorded.get("quantization"))
        raise ResumeMismatchError(
            f"{output_dir} was written by an engine whose settings resolved differently:\n{lines}\n{hint}.")


def _scheme_hint(quantization: Optional[str]) -> str:
    """What to do when the recorded rows came from other quantized arithmetic than this machine resolves to."""
    if quantization == "int4":
        return ("engine.quantization=int4 computes in int8 (W4A8, quantization_scheme w4a8) where batchgen's AVX-512 "
                "VNNI kernel runs, else int4 weight-only (as batchgen did before W4A8); the recorded rows came from "
                "the other arithmetic: resume on a machine that resolves as recorded (on a VNNI CPU, "
                "BATCHGEN_CPU_ISA=avx2 runs int4 weight-only), or write to a new output_dir")
    return ("engine.quantization=int8 computes in int8 (W8A8, quantization_scheme w8a8) where the CPU's int8 GEMM is "
            "exact, else int8 weight-only (as batchgen did before W8A8); the recorded rows came from the other "
            "arithmetic: resume on a machine that resolves as recorded (weight-only was since renamed "
            "engine.quantization=int8_wo, a new output_dir), or write to a new output_dir")


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed between two manifests, compared redacted (a manifest written before redaction may hold a
    secret: it is neither compared nor shown). A digest the model's entry gained since the old manifest was
    written (a weight file's `sha256`, the prompt files) is compared where both hold it: an output made before it
    resumes on the digests it recorded."""
    out = []
    for key in ("output_config", "input", "model"):
        out += _diff(redact(old.get(key)), redact(new.get(key)), key)
    return out


ADDED_DIGESTS = ("sha256", "prompt_files", "tokenizer_files")  # an output made before prompt_identity: unchecked


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted((set(a) | set(b)) - {k for k in ADDED_DIGESTS if k not in a}, key=str)
        return [line for k in keys for line in _diff(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [line for i, (x, y) in enumerate(zip(a, b)) for line in _diff(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: was {a!r}, now {b!r}"]


def file_metadata(config_digest: str, model: dict[str, Any]) -> dict[str, str]:
    """What every part file of the job carries in its metadata: the config hash, the model's identity, the version."""
    return {"batchgen.config_hash": config_digest, "batchgen.model": json.dumps(model),
            "batchgen.version": __version__}
