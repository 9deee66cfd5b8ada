"""Checking a job's config before anything runs: `validate` reports every problem at once, each naming its keys as
the user types them (and what to set instead), across sections: the engine's own keys and what it supports, the
task's, the per-row columns', the output's and its table's, the launcher's and the output directory's."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

from batchgen.constraints import KINDS as CONSTRAINT_KINDS
from batchgen.engines import ENGINES, engine_config, engine_problems, structured_output_problems
from batchgen.errors import ConfigError
from batchgen.job import ON_BAD_ROW, TOO_LONG, JobConfig, OutputConfig, Question, RunConfig
from batchgen.prompts.texts import unescape
from batchgen.redact import control_character, remember_secrets


def validate(given: JobConfig) -> JobConfig:
    """Report every problem at once, naming keys as the user types them; raise ConfigError if any. Returns the job
    as resolved (its engine's own config class, output_dir's ${name}, run.shard and run.num_shards, an OpenAI batch
    input's columns, the text keys' newlines: texts.py), a copy: the config it was given is left as it was."""
    cfg = copy.deepcopy(given)
    if not cfg.texts_unescaped:  # `\n` in a text key is a newline (texts.py), applied once
        cfg.map_texts(unescape)
        cfg.texts_unescaped = True
    cfg.engine, problems = engine_config(cfg.engine)  # its engine's own config class (made in Python: maybe not)
    problems += _slurm_defaults(cfg.run)
    if not cfg.name or cfg.name == "???":
        problems.append("name is required: pick a job (job=demo) or set name=...")
    elif "${name}" in cfg.output_dir:  # a JobConfig made in Python: Hydra's interpolation, done here
        cfg.output_dir = cfg.output_dir.replace("${name}", cfg.name)
    if cfg.dataset.format == "openai_batch" and not cfg.dataset.problems():
        from batchgen.reader.openai_batch import configure

        problems += configure(cfg.dataset)  # the request columns, by the file's endpoint
    sampling_problems = cfg.sampling.problems()
    if not sampling_problems and cfg.engine.name in ENGINES:
        constraint = cfg.sampling.constraint()
        sampling_problems = structured_output_problems(cfg.engine, constraint and constraint.kind,
                                                       cfg.sampling.choice_scores, cfg.sampling.reasoning,
                                                       cfg.sampling.max_reasoning_tokens)
    problems += cfg.engine.problems() + cfg.dataset.problems() + sampling_problems + _run_problems(cfg.run)
    problems += _per_row_problems(cfg) + cfg.launcher.problems()
    problems += engine_problems(cfg.engine, cfg.sampling, cfg.dataset) + _output_problems(cfg) + _task_problems(cfg)
    if cfg.launcher.name == "ray" and "://" in cfg.output_dir:
        problems.append("launcher=ray writes output_dir from every worker: use a shared filesystem path, not a URL")
    if cfg.launcher.name == "ray" and cfg.run.num_shards != 1:
        problems.append("launcher=ray runs the whole job (its workers pull the parts): leave run.shard and "
                        "run.num_shards unset")
    problems += output_dir_problems(cfg.output_dir) + _secret_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


TASKS = ("generate", "loglik", "embed", "decide")
KINDS = ("predicate", "choice", "score")
POOLINGS = ("mean", "last")


def _task_problems(cfg: JobConfig) -> list[str]:
    """task=loglik and task=embed read rows, they do not sample: the hf engine, one sample a row, no constraint or
    decoding key."""
    if cfg.task not in TASKS:
        return [f"task must be one of {', '.join(TASKS)} (got {cfg.task!r})"]
    out = [] if cfg.dataset.text_column is None or cfg.task == "loglik" else [
        "dataset.text_column is the text task=loglik scores; set task=loglik or remove it"]
    if cfg.embed.pooling not in POOLINGS:
        out.append(f"embed.pooling must be one of {', '.join(POOLINGS)} (got {cfg.embed.pooling!r})")
    if cfg.task == "generate":
        return out
    if cfg.task == "decide":
        out += _question_problems(cfg.decide.questions)
    s = cfg.sampling
    spec = ENGINES.get(cfg.engine.name)
    if spec is not None and cfg.task not in spec.tasks:
        runs = ", ".join(f"engine={name}" for name, s in ENGINES.items() if cfg.task in s.tasks)
        out.append(f"task={cfg.task} runs on {runs} (got engine={cfg.engine.name})")
    decoding = [key for key, value in (("sampling.n", s.n != 1), ("sampling.num_beams", s.num_beams != 1),
                                       ("sampling.logprobs", s.logprobs is not None),
                                       ("sampling.choice_scores", s.choice_scores),
                                       ("sampling.reasoning", s.reasoning != "off"),
                                       ("a sampling constraint", s.constraint() is not None)) if value]
    out += [f"{key}: task={cfg.task} generates nothing; leave it at its default" for key in decoding]
    return out


def _question_problems(questions: list[Question]) -> list[str]:
    """task=decide's questions: at least one, each named as a column can be, of a known kind with its answers."""
    if not questions:
        return ["task=decide asks decide.questions: a list of {name, kind, prompt, options | levels} (see "
                "docs/engines.md, Scoring)"]
    out, seen = [], set()
    for i, q in enumerate(questions):
        where = f"decide.questions[{i}]"
        if not q.name or q.name == "???" or not q.name.isidentifier() or q.name in seen:
            out.append(f"{where}.name must be a unique identifier (its output column; got {q.name!r})")
        seen.add(q.name)
        if q.kind not in KINDS:
            out.append(f"{where}.kind must be one of {', '.join(KINDS)} (got {q.kind!r})")
        if q.kind in ("choice", "predicate"):
            out += option_problems(where, q)
        if q.kind == "score" and not 2 <= q.levels <= 100:
            out.append(f"{where}.levels must be in 2..100 (got {q.levels})")
        if q.abstain_below is not None and not 0 < q.abstain_below <= 1:
            out.append(f"{where}.abstain_below must be in (0, 1] (got {q.abstain_below})")
    return out


def option_problems(where: str, q: Question) -> list[str]:
    """A predicate's and a choice's options, checked alike: the answers are scored against each other, so two the
    same split every row's probability between them (0.5/0.5 for a predicate), and an empty or blank one is scored
    as EOS alone, which wins every row; either way the column says nothing, so the job is refused at start."""
    opts = q.options
    if q.kind == "choice" and len(opts) < 2:
        return [f"{where}.options: a choice needs at least two distinct options (question {q.name!r})"]
    if q.kind == "predicate" and opts and len(opts) != 2:
        return [f"{where}.options: a predicate's options are its yes and no answers, two (or none: yes, no; "
                f"question {q.name!r})"]
    out, first = [], {}
    for j, option in enumerate(opts):
        text = option if isinstance(option, str) else None
        if text is None or not text.strip():
            out.append(f"{where}.options[{j}] of question {q.name!r} is {option!r}: an answer must be non-blank "
                       f"text (a blank one is scored as EOS alone and wins every row); write the answer's words")
        elif text.strip() in first:
            out.append(f"{where}.options[{j}] of question {q.name!r} is {option!r}, the same answer as "
                       f"options[{first[text.strip()]}]: a choice needs at least two distinct options (two the "
                       f"same split every row between them); remove or rename one")
        else:
            first[text.strip()] = j
    return out


def _output_problems(cfg: JobConfig) -> list[str]:
    """output.format against the launcher and output_dir."""
    out = []
    if cfg.output.format not in ("parquet", "openai_batch"):
        out.append(f"output.format must be parquet or openai_batch (got {cfg.output.format!r})")
    if cfg.output.format == "openai_batch" and (cfg.launcher.name == "ray" or "://" in cfg.output_dir):
        out.append("output.format=openai_batch is written on a local output_dir by launcher=local (run "
                   "batchgen finalize on the shared output after a Ray job)")
    prices = cfg.output.prices
    if prices.given and (prices.input is None or prices.output is None):
        out.append("output.prices needs both input and output (per million tokens), e.g. "
                   "output.prices='{input: 0.15, output: 0.6}'")
    out += [f"output.prices.{key} must be >= 0 (got {value})" for key, value in vars(prices).items()
            if value is not None and value < 0]
    return out + _sink_problems(cfg.output)


def _sink_problems(output: OutputConfig) -> list[str]:
    """output.sink and the keys of a table output."""
    out = []
    if output.sink not in ("parquet", "delta", "iceberg"):
        out.append(f"output.sink must be parquet, delta or iceberg (got {output.sink!r})")
    if output.mode not in ("append", "upsert"):
        out.append(f"output.mode must be append or upsert (got {output.mode!r})")
    if output.schema_evolution not in ("none", "add_columns"):
        out.append(f"output.schema_evolution must be none or add_columns (got {output.schema_evolution!r})")
    if output.sink == "parquet":
        if output.table or output.mode != "append":
            out.append("output.table and output.mode=upsert are for a table output: set output.sink=delta or iceberg")
        return out
    if not output.table:
        where = "a path or URL, e.g. output.table=s3://bucket/annotations" if output.sink == "delta" else \
            "namespace.table in output.catalog, e.g. output.table=nightly.annotations"
        out.append(f"output.sink={output.sink} needs output.table: {where}")
    elif output.sink == "iceberg" and "." not in output.table:
        out.append(f"output.table={output.table!r}: an Iceberg table is named namespace.table")
    if output.sink == "iceberg" and not output.catalog:
        out.append("output.sink=iceberg needs output.catalog, pyiceberg's catalog properties, e.g. "
                   "output.catalog='{type: sql, uri: \"sqlite:///cat.db\", warehouse: \"file:///data/warehouse\"}'")
    package = {"delta": "deltalake", "iceberg": "pyiceberg"}[output.sink]
    if importlib.util.find_spec(package) is None:
        out.append(f"output.sink={output.sink} needs the {package} package: pip install 'batchgen[{output.sink}]'")
    return out


def _secret_problems(cfg: JobConfig) -> list[str]:
    """The job's secrets remembered (masked in every text from now on: redact.py), and a value of
    output.storage_options or output.catalog (an object store's or a catalog's setting, a credential among them)
    that holds a control character refused, named by its key and never quoted."""
    remember_secrets(dataclasses.asdict(cfg))
    out = []
    for where, options in (("output.storage_options", cfg.output.storage_options),
                           ("output.catalog", cfg.output.catalog)):
        for key, value in options.items():
            why = control_character(value) if isinstance(value, str) else None
            if why:
                out.append(f"{where}.{key} holds {why} (the value is not shown: it may be a credential); set it "
                           f"without it (a value read from a file saved with Windows line ends ends in \\r)")
    return out


def _slurm_defaults(run: RunConfig) -> list[str]:
    """run.shard / run.num_shards left null: a Slurm array task's own share, else the whole job (0 of 1)."""
    env = os.environ
    task, count = env.get("SLURM_ARRAY_TASK_ID"), env.get("SLURM_ARRAY_TASK_COUNT")
    if task is not None and count is not None and (run.shard is None or run.num_shards is None):
        try:
            shard, shards = int(task) - int(env.get("SLURM_ARRAY_TASK_MIN", "0")), int(count)
        except ValueError:
            return [f"run.shard: the Slurm array environment is not numeric (SLURM_ARRAY_TASK_ID={task!r}, "
                    f"SLURM_ARRAY_TASK_COUNT={count!r}); set run.shard and run.num_shards"]
        run.shard = shard if run.shard is None else run.shard
        run.num_shards = shards if run.num_shards is None else run.num_shards
    run.shard = 0 if run.shard is None else run.shard
    run.num_shards = 1 if run.num_shards is None else run.num_shards
    return []


def _per_row_problems(cfg: JobConfig) -> list[str]:
    """The per-row constraint columns against the job's sampling.* (the values themselves are checked per row)."""
    ds, s, out = cfg.dataset, cfg.sampling, []
    if ds.schema_column and not s.schemas:
        out.append("dataset.schema_column needs sampling.schemas: the named schemas its values choose from")
    if s.schemas and not ds.schema_column:
        out.append("sampling.schemas is used through dataset.schema_column (set it, or use sampling.json_schema)")
    if s.choice_scores and not s.choice and not ds.choice_column:
        out.append("sampling.choice_scores=true needs sampling.choice or dataset.choice_column (the labels to score)")
    if (ds.choice_column or ds.schema_column) and (s.regex or s.grammar):
        out.append("dataset.choice_column / dataset.schema_column cannot go with sampling.regex or sampling.grammar")
    return out + _min_tokens_problems(cfg)


def _min_tokens_problems(cfg: JobConfig) -> list[str]:
    """min_tokens masks EOS, which a constrained sample needs the moment its constraint is complete (a row's own
    min_tokens or constraint: that row's bad_value, rowparams)."""
    s = cfg.sampling
    if s.min_tokens and any(getattr(s, kind) not in (None, "", []) for kind in CONSTRAINT_KINDS):
        return ["sampling.min_tokens cannot go with a sampling constraint: a constrained sample ends when its "
                "constraint is complete"]
    return []


MIN_FREE_BYTES = 64 << 20  # an output_dir on a disk with less free space is refused at start


def output_dir_problems(output_dir: str) -> list[str]:
    """output_dir (or the nearest folder it would be made in) must be a writable directory on a disk with room."""
    if "://" in output_dir:  # object storage: its filesystem must be installed (the writes tell the rest)
        import fsspec

        protocol = output_dir.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            return [f"output_dir: {protocol}:// needs a package ({exc}); for s3:// pip install s3fs"]
        return []
    path = Path(output_dir)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        return [f"output_dir: {existing} is a file, not a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"output_dir: {existing} is not writable (read-only or no permission); choose another output_dir"]
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        return [f"output_dir: the disk holding {existing} has {free // (1 << 20)} MiB free; free space or choose "
                f"another output_dir"]
    return []


def _run_problems(run: RunConfig) -> list[str]:
    out = []
    if run.rows_per_part is not None and run.rows_per_part < 1:
        out.append(f"run.rows_per_part must be >= 1 or null (got {run.rows_per_part})")
    if run.lookahead_parts is not None and run.lookahead_parts < 0:
        out.append(f"run.lookahead_parts must be >= 0 or null (got {run.lookahead_parts}); 0 runs one part at a time")
    if run.on_bad_row not in ON_BAD_ROW:
        out.append(f"run.on_bad_row must be one of {', '.join(ON_BAD_ROW)} (got {run.on_bad_row!r})")
    if run.too_long not in TOO_LONG:
        out.append(f"run.too_long must be one of {', '.join(TOO_LONG)} (got {run.too_long!r})")
    if not 0 <= run.max_error_rate <= 1:
        out.append(f"run.max_error_rate must be in [0, 1] (got {run.max_error_rate})")
    if run.attempt < 0:
        out.append(f"run.attempt must be >= 0 (got {run.attempt}); batchgen retry sets it")
    if run.num_shards < 1:
        out.append(f"run.num_shards must be >= 1 (got {run.num_shards})")
    elif not 0 <= run.shard < run.num_shards:
        out.append(f"run.shard must be in [0, run.num_shards) = [0, {run.num_shards}) (got {run.shard})")
    return out

