"""The command line: the one module that knows Hydra.

`batchgen [job=NAME] [key=value ...]` composes conf/, converts it to JobConfig dataclasses once,
validates it and runs the job. `batchgen status OUTPUT_DIR` reads a run's progress off disk; `plan`, `retry` and
`finalize` are their own modules, handed the config composition they need from here.
Exit codes (docs/contract.md section 7): 0 done, 1 runtime failure or error rate exceeded, 2 config or input error;
143 / 130 stopped by SIGTERM / SIGINT after journaling finished results (rerun the same command to resume).
"""

from __future__ import annotations

from batchgen.engines import prepare_process

prepare_process()  # before torch loads: OpenMP's threads spin briefly, then sleep (engines/hf/cpu/runtime.py)

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from batchgen.engines import ENGINES, foreign_key  # noqa: E402
from batchgen.errors import BatchgenError, ConfigError  # noqa: E402
from batchgen.job import (  # noqa: E402
    JobConfig,
    LauncherConfig,  # noqa: E402
    OutputConfig,
    RunConfig,
    validate,
)
from batchgen.output.remote import RemoteOutput, is_remote  # noqa: E402
from batchgen.reader import DatasetConfig  # noqa: E402
from batchgen.run.stopping import StopRequested  # noqa: E402
from batchgen.sampling import SamplingConfig  # noqa: E402

log = logging.getLogger("batchgen")
CONF_DIR = os.environ.get("BATCHGEN_CONF_DIR") or str(Path(__file__).resolve().parents[2] / "conf")
_entered_job = False  # set once Hydra has composed the config and handed it to us
LOGS = "_logs"  # Hydra's run folders, in output_dir (conf/config.yaml: hydra.run.dir)
_logs_home: Optional[tuple[Path, Optional[set[str]]]] = None  # where they go, and what was there before the run

ConfigStore.instance().store(name="batchgen_schema", node=JobConfig)
for _name, _spec in ENGINES.items():  # each engine's config class, under its group file (conf/engine/NAME.yaml)
    ConfigStore.instance().store(group="engine", name=f"{_name}_schema", node=_spec.config)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """The one conversion from Hydra's config to dataclasses."""
    try:
        job = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError([f"{key}: {getattr(exc, 'msg', exc)}"]) from exc
    assert isinstance(job, JobConfig)
    return validate(job)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    global _entered_job
    _entered_job = True
    try:
        job = to_job_config(cfg)
        from batchgen.run.runner import run_job

        resolved = OmegaConf.to_container(cfg, resolve=True)
        summary = run_job(job, resolved)  # type: ignore[arg-type]
    except BatchgenError as exc:
        log.error("%s", exc)
        print(f"batchgen: error: {exc}", file=sys.stderr)
        if exc.exit_code == 2:
            _forget_refused_run()
        sys.exit(exc.exit_code)
    except StopRequested as exc:
        print(f"batchgen: {exc}; committed parts and journaled results are kept, rerun the same command to resume",
              file=sys.stderr)
        _exit_now(exc.exit_code)
    except KeyboardInterrupt:
        print("batchgen: interrupted; committed parts are kept, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    print(summary.render())


def _entries(directory: Path) -> Optional[set[str]]:
    """The names in `directory`; None where it does not exist."""
    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        return None


def _forget_refused_run() -> None:
    """A job refused at start (exit 2: config, input, refused resume) in a new output_dir leaves no output_dir
    behind: Hydra made it, with this run's log folder (`_logs/<time>`), before the job's own checks ran. Kept where
    output_dir was there before (each run its own log folder, refused or not), where the job wrote anything beside
    the logs, or where hydra.run.dir is the user's own place."""
    if _logs_home is None or _logs_home[1] is not None:
        return
    home = _logs_home[0]
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    if run_dir.parent != home / LOGS or (_entries(home) or set()) - {LOGS}:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for directory in (home / LOGS, home):
        with contextlib.suppress(OSError):  # not empty: another run started there meanwhile
            directory.rmdir()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown (about 3 s with torch loaded, measured on 2 CPU cores): on a stop
    everything durable is already on disk (journal fsynced, status written, lock released)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


GROUPS = ("job", "engine", "dataset", "sampling", "launcher")  # config groups: `engine=vllm` picks a file, not a key


def unknown_keys(overrides: list[str], engine: Optional[str] = None) -> list[str]:
    """Every override naming a key JobConfig does not have (Hydra stops at the first), with a likely spelling; an
    engine.* key is checked against `engine`'s config class (against every engine's when it is not known)."""
    problems = []
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" not in arg or key.startswith("hydra") or key in GROUPS:
            continue
        if key.startswith("engine."):
            problems += _engine_key_problems(key, arg.split("=", 1)[1], engine)
            continue
        node: object = JobConfig
        for i, name in enumerate(key.split(".")):
            if not dataclasses.is_dataclass(node):
                break  # a dict-valued key: any sub-key goes
            fields = {f.name: f for f in dataclasses.fields(node)}
            if name not in fields:
                problems.append(_no_such_key(key, ".".join(key.split(".")[:i]), list(fields)))
                break
            typ = fields[name].type
            node = SECTIONS.get(typ if isinstance(typ, str) else getattr(typ, "__name__", ""))
    return problems


# JobConfig's sections by type name (its annotations are strings), for walking a dotted key
SECTIONS = {"DatasetConfig": DatasetConfig, "SamplingConfig": SamplingConfig, "RunConfig": RunConfig,
            "LauncherConfig": LauncherConfig, "OutputConfig": OutputConfig}


def _no_such_key(key: str, prefix: str, names: list[str]) -> str:
    import difflib

    known = [f"{prefix}.{name}" if prefix else name for name in names]
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}: no such config key{hint}; see docs/configuration.md \"Config reference\""


def _engine_key_problems(key: str, value: str, engine: Optional[str]) -> list[str]:
    """engine.KEY: a key of the chosen engine's config class (any engine's when the choice is not known yet); a
    dict-valued key (engine.extra_args.*) takes any sub-key."""
    name = key.split(".")[1]
    every = {f.name for spec in ENGINES.values() for f in dataclasses.fields(spec.config)}
    if name not in every:
        return [_no_such_key(key, "engine", sorted(every))]
    if engine in ENGINES and name not in {f.name for f in dataclasses.fields(ENGINES[engine].config)}:
        return [foreign_key(name, value, engine)]
    return []


def _chosen_engine(overrides: list[str]) -> Optional[str]:
    """engine.name as the config groups picked in `overrides` (engine=..., job=...) make it; None when they do not
    compose (the full composition then says why). Call inside Hydra's initialize_config_dir."""
    from hydra import compose

    groups = [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") in GROUPS]
    groups += [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") == "engine.name"]
    try:
        return compose(config_name="config", overrides=groups).engine.name
    except Exception:  # noqa: BLE001 - reported by the full composition
        return None


def compose_checked(overrides: list[str]) -> JobConfig:
    """The job config from `overrides`, composed without starting a Hydra run (nothing written), and validated;
    ConfigError with every problem (unknown keys with their likely spelling, composition errors, bad values)."""
    from hydra import compose, initialize_config_dir

    problems = unreadable(overrides) + unknown_options(overrides)
    if problems:
        raise ConfigError(problems)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        problems = unknown_keys(overrides, _chosen_engine(overrides))
        if not problems:
            try:
                cfg = compose(config_name="config", overrides=overrides)
                if OmegaConf.is_missing(cfg, "name"):
                    problems.append("name is required: pick a job (job=demo) or set name=...")
                else:
                    return to_job_config(cfg)
            except ConfigError as exc:
                problems += exc.problems
            except Exception as exc:  # Hydra's composition errors: a bad value for a key's type, say
                problems.append(hydra_reason(exc))
    raise ConfigError(problems)


def unreadable(overrides: list[str]) -> list[str]:
    """Overrides Hydra's grammar cannot read (braces, `\\n`, non-ASCII characters... in an unquoted value): one
    problem each, naming the key and the quoting that works."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, problems = OverridesParser.create(), []
    for arg in overrides:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            key, _, value = arg.partition("=")
            quoted = value.replace('"', '\\"')
            problems.append(f"{key}: Hydra's override grammar cannot read this value unquoted (braces, quotes, "
                            f"backslashes or non-ASCII characters need quoting). Quote it for Hydra inside the "
                            f"shell's quotes: '{key}=\"{quoted[:60]}{'...' if len(quoted) > 60 else ''}\"', or set "
                            f"it in a preset (a YAML file: docs/configuration.md, \"Running jobs\"), where any text "
                            f"goes")
    return problems


def unknown_options(overrides: list[str]) -> list[str]:
    """GROUP=CHOICE naming no file of conf/GROUP/: the choices, and the likely one."""
    import difflib

    problems = []
    for arg in overrides:
        group, _, choice = arg.partition("=")
        group = group.lstrip("+~")
        if group not in GROUPS or choice in ("", "null") or (Path(CONF_DIR) / group / f"{choice}.yaml").is_file():
            continue
        options = group_options(group)
        close = difflib.get_close_matches(choice, options, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        problems.append(f"{group}={choice}: no such option{hint}; choices: {', '.join(options)}")
    return problems


def group_options(group: str) -> list[str]:
    """The choices of config group `group`: its files in conf/."""
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def hydra_reason(exc: Exception) -> str:
    """Hydra's composition error as one line with its reason (its first line alone drops it: "Error merging
    override sampling.temperature=hot"); OmegaConf's key and type bookkeeping left out."""
    text = "\n".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith(("full_key:", "reference_type=", "object_type=",
                                                           "To append to your config"))]
    return ": ".join(keep[:2]) if keep else type(exc).__name__


def config_from(resolved: dict, overrides: list[str]) -> JobConfig:
    """A job config from an earlier run's resolved config (its manifest's `config`) with `overrides` on top, validated
    (batchgen retry); ConfigError naming every problem."""
    engine = resolved.get("engine") if isinstance(resolved.get("engine"), dict) else {}
    spec = ENGINES.get(engine.get("name", "hf"))
    problems = group_switches(overrides, resolved) + unknown_keys(overrides, engine.get("name", "hf"))
    if problems:
        raise ConfigError(problems)
    if spec is not None:  # its engine's class; an output written before engines had their own keeps only those
        mine = {f.name for f in dataclasses.fields(spec.config)}
        resolved = resolved | {"engine": {k: v for k, v in engine.items() if k in mine}}
    schema = OmegaConf.structured(JobConfig)
    try:
        if spec is not None:
            schema = OmegaConf.merge(schema, {"engine": OmegaConf.structured(spec.config)})
        cfg = OmegaConf.merge(schema, resolved, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError([f"{getattr(exc, 'full_key', None) or 'config'}: {getattr(exc, 'msg', exc)}"]) from exc
    return to_job_config(cfg)  # type: ignore[arg-type]


def group_switches(overrides: list[str], resolved: dict) -> list[str]:
    """A config group picked on top of an earlier run's resolved config (`sampling=sample` on a retry): Hydra picks
    a group's file when it composes, and that config is composed already. One problem each, naming what to set
    instead."""
    problems = []
    for arg in overrides:
        key, _, choice = arg.partition("=")
        group = key.lstrip("+~")
        if group in GROUPS:
            problems.append(f"{arg}: a retry cannot switch the config group {group} (it starts from the job's "
                            f"resolved config); {_instead(group, choice, resolved.get(group))}")
    return problems


def _instead(group: str, choice: str, current: object) -> str:
    """What to set instead of `group=choice`: the keys of conf/GROUP/CHOICE.yaml whose values differ from the
    job's (`current`)."""
    path = Path(CONF_DIR) / group / f"{choice}.yaml"
    if group == "job":  # a preset of the whole config
        return "set the keys you want changed one by one, e.g. sampling.temperature=0.7"
    picked = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else None
    if not isinstance(picked, dict) or not isinstance(current, dict):
        return f"set the keys under {group} one by one, e.g. {group}.KEY=VALUE"
    changes = " ".join(f"{group}.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in picked.items()
                       if not isinstance(v, dict) and current.get(k) != v)  # json: as Hydra's grammar reads it
    if not changes:
        return f"the job's config has what {group}/{choice}.yaml sets already: leave it out"
    return f"set the keys it would change instead: {changes}"


def preflight(overrides: list[str]) -> JobConfig:
    """Compose and validate the config before Hydra starts the job (and writes output_dir/_logs): every unknown
    key, config problem, missing path or model and unusable output_dir reported at once, one line each, exit 2."""
    try:
        return compose_checked(overrides)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"batchgen: error: {line}", file=sys.stderr)
        sys.exit(2)


# The subcommands, each its own module in commands/ with a main(argv, ...) -> exit code; one line each for --help
COMMANDS = {
    "plan": "what a job would do, before it runs: prompt lengths, rows too long or erring, parts (--calibrate: "
            "rate and ETA)",
    "status": "a run's progress, errors and work in flight, read from OUTPUT_DIR (a killed run's too)",
    "report": "one self-contained HTML page of what a run did",
    "retry": "generate again the rows of a finished job that erred with a retryable kind (too_long, ...)",
    "finalize": "after the shards of a job ran: write _SUCCESS once every part of every shard exists",
}


def usage() -> str:
    """`batchgen --help`: how to run a job, the subcommands, the config groups and their options."""
    from batchgen.version import __version__

    commands = "\n".join(f"  {name:<9} {line}" for name, line in COMMANDS.items())
    groups = "\n".join(f"  {group:<9} {', '.join(group_options(group))}" for group in GROUPS)
    return f"""batchgen {__version__}: offline batch generation with LLMs, resumable, exactly once per row.

usage: batchgen [job=NAME] [GROUP=OPTION ...] [key=value ...]   run a job (a Hydra config)
       batchgen COMMAND [--help] ...                            one of the commands below
       batchgen --version

commands:
{commands}

config groups (GROUP=OPTION; job=NAME picks a preset):
{groups}

Every key, its default and meaning: docs/configuration.md, "Config reference". `batchgen job=NAME --cfg job` prints
the composed config without running it; `batchgen --hydra-help` shows Hydra's own flags.
Exit codes: 0 done, 1 runtime failure, 2 config or input error, 143/130 stopped by SIGTERM/SIGINT (rerun to resume).
"""


def main() -> None:
    global _logs_home
    first = sys.argv[1] if len(sys.argv) > 1 else None
    if first in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    if first in ("-V", "--version"):
        from batchgen.version import __version__

        print(f"batchgen {__version__}")
        sys.exit(0)
    if first == "status":
        from batchgen.commands.status import main as status_main

        sys.exit(status_main(sys.argv[2:]))
    if first == "plan":
        from batchgen.commands.plan import main as plan_main

        sys.exit(plan_main(sys.argv[2:], compose_checked))
    if first == "report":
        from batchgen.commands.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if first == "retry":
        from batchgen.commands.retry import main as retry_main

        sys.exit(retry_main(sys.argv[2:], config_from))
    if first == "finalize":
        from batchgen.commands.finalize import main as finalize_main

        sys.exit(finalize_main(sys.argv[2:]))
    if not any(arg.startswith("-") for arg in sys.argv[1:]):  # Hydra's own flags (--help, -m) go straight to it
        cfg = preflight(sys.argv[1:])
        home = RemoteOutput(cfg.output_dir).staging if is_remote(cfg.output_dir) else Path(cfg.output_dir)
        if is_remote(cfg.output_dir) and not any(a.startswith("hydra.run.dir=") for a in sys.argv):
            # Hydra's logs are local files: for an output on object storage, in its staging directory
            sys.argv.append(f"hydra.run.dir={home}/{LOGS}/" + "${now:%Y-%m-%d_%H-%M-%S-%f}")
        _logs_home = (home.resolve(), _entries(home))  # before Hydra makes its run folder there
    try:
        _hydra_main()
    except SystemExit as exc:
        if exc.code not in (0, None) and not _entered_job:
            sys.exit(2)  # Hydra could not compose the config: an unknown key, group or value
        raise
