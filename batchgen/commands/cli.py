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

from batchgen.engines.base import EngineConfig  # noqa: E402
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


def unknown_keys(overrides: list[str]) -> list[str]:
    """Every override naming a key JobConfig does not have (Hydra stops at the first), with a likely spelling."""
    import dataclasses
    import difflib

    problems = []
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" not in arg or key.startswith("hydra") or key in GROUPS:
            continue
        node: object = JobConfig
        known: list[str] = []
        for i, name in enumerate(key.split(".")):
            if not dataclasses.is_dataclass(node):
                break  # a dict-valued key (engine.extra_args.*): any sub-key goes
            fields = {f.name: f for f in dataclasses.fields(node)}
            if name not in fields:
                prefix = ".".join(key.split(".")[:i])
                known = [f"{prefix}.{f}" if prefix else f for f in fields]
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{key}: no such config key{hint}; see docs/configuration.md \"Config reference\"")
                break
            typ = fields[name].type
            node = {"EngineConfig": EngineConfig, "DatasetConfig": DatasetConfig, "SamplingConfig": SamplingConfig,
                    "RunConfig": RunConfig, "LauncherConfig": LauncherConfig, "OutputConfig": OutputConfig,
                    }.get(typ if isinstance(typ, str) else getattr(typ, "__name__", ""))
    return problems


def compose_checked(overrides: list[str]) -> JobConfig:
    """The job config from `overrides`, composed without starting a Hydra run (nothing written), and validated;
    ConfigError with every problem (unknown keys with their likely spelling, composition errors, bad values)."""
    from hydra import compose, initialize_config_dir

    problems = unknown_keys(overrides)
    if not problems:
        try:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides)
            if OmegaConf.is_missing(cfg, "name"):
                problems.append("name is required: pick a job (job=demo) or set name=...")
            else:
                return to_job_config(cfg)
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:  # Hydra's composition errors: a bad group, value or override syntax
            problems.append(str(exc).splitlines()[0])
    raise ConfigError(problems)


def config_from(resolved: dict, overrides: list[str]) -> JobConfig:
    """A job config from an earlier run's resolved config (its manifest's `config`) with `overrides` on top, validated
    (batchgen retry); ConfigError naming every problem."""
    problems = group_switches(overrides, resolved) + unknown_keys(overrides)
    if problems:
        raise ConfigError(problems)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(JobConfig), resolved, OmegaConf.from_dotlist(overrides))
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


def main() -> None:
    global _logs_home
    if len(sys.argv) > 1 and sys.argv[1] == "status":
        from batchgen.commands.status import main as status_main

        sys.exit(status_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "plan":
        from batchgen.commands.plan import main as plan_main

        sys.exit(plan_main(sys.argv[2:], compose_checked))
    if len(sys.argv) > 1 and sys.argv[1] == "report":
        from batchgen.commands.report import main as report_main

        sys.exit(report_main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "retry":
        from batchgen.commands.retry import main as retry_main

        sys.exit(retry_main(sys.argv[2:], config_from))
    if len(sys.argv) > 1 and sys.argv[1] == "finalize":
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
