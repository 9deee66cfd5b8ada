"""The command line: `batchgen [job=NAME] [key=value ...]` runs a job under hydra.main (its config composed and
checked first by commands/compose.py, the one module that composes Hydra's config); `batchgen COMMAND ...` runs a
command's module (plan, status, report, retry, finalize), handed the composition it needs. `--config-dir DIR` (the
user's presets) applies to every command; `--help` and `--version` explain the CLI.
Exit codes (docs/contract.md section 7): 0 done, 1 runtime failure or error rate exceeded, 2 config or input error;
143 / 130 stopped by SIGTERM / SIGINT after journaling finished results (rerun the same command to resume).
"""

from __future__ import annotations

from batchgen.engines import prepare_process

prepare_process()  # before torch loads: OpenMP's threads spin briefly, then sleep (engines/hf/backends/cpu/runtime.py)

import contextlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from batchgen.commands.compose import (  # noqa: E402
    CONF_DIR,
    USER_CONF_ENV,
    compose_checked,
    config_from,
    group_options,
    take_config_dirs,
    to_job_config,
    with_search_path,
)
from batchgen.commands.keynames import GROUPS  # noqa: E402
from batchgen.commands.terminal import error_text, escape_console, lines, one_line  # noqa: E402
from batchgen.errors import BatchgenError, ConfigError, LockedError  # noqa: E402
from batchgen.job import JobConfig  # noqa: E402
from batchgen.output.remote import RemoteOutput, is_remote  # noqa: E402
from batchgen.redact import redact, redact_logs, redact_text, remember_secrets  # noqa: E402
from batchgen.run.stopping import StopRequested  # noqa: E402

log = logging.getLogger("batchgen")
LOGS = "_logs"  # Hydra's run folders, in output_dir (conf/config.yaml: hydra.run.dir)
Advice = Callable[[BatchgenError], Optional[str]]  # a command's line of advice on its job's error (nightly, increment)


@dataclass
class Invocation:
    """This process's command line, as the job under hydra.main needs it (Hydra calls _hydra_main without
    arguments, so what main() and run_as_job() learned waits here)."""

    command: str = "batchgen"  # the command as typed: the line that resumes a stopped run
    entered_job: bool = False  # Hydra composed the config and handed it over
    logs_home: Optional[tuple[Path, Optional[set[str]]]] = None  # where the run's logs go, and what was there before
    advice: Optional[Advice] = None  # the calling command's advice on its job's error (nightly, increment)


invocation = Invocation()


def resume_line() -> str:
    return f"rerun the same command to resume: {redact_text(invocation.command)}"

@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    invocation.entered_job = True
    _keep_secrets_out(cfg)
    try:
        job = to_job_config(cfg)
        from batchgen.run.runner import run_job

        resolved = OmegaConf.to_container(cfg, resolve=True)
        summary = run_job(job, resolved)  # type: ignore[arg-type]
    except BatchgenError as exc:
        _to_log_file(logging.ERROR, f"{exc}")  # the console gets it once, from the line below
        print(f"batchgen: error: {redact_text(error_text(exc))}", file=sys.stderr)  # may quote a row: escaped
        advice = invocation.advice(exc) if invocation.advice is not None else None
        if advice:
            print(f"batchgen: {redact_text(advice)}", file=sys.stderr)
        if exc.exit_code == 2:
            _forget_refused_run(other_writer=isinstance(exc, LockedError))
        elif exc.resumable:  # a runtime failure: what is committed and journaled stays, and the same command resumes
            print(f"batchgen: committed parts and journaled results are kept; {resume_line()}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except StopRequested as exc:
        print(f"batchgen: {one_line(redact_text(str(exc)))}; committed parts and journaled results are kept, "
              f"{resume_line()}",
              file=sys.stderr)
        _exit_now(exc.exit_code)
    except KeyboardInterrupt:
        print(f"batchgen: interrupted; committed parts are kept, {resume_line()}", file=sys.stderr)
        sys.exit(130)
    print(lines(summary.render()))


def _keep_secrets_out(cfg: DictConfig) -> None:
    """No secret (a URL's user, password or query values, a value under a secret name: redact.py) goes into the
    run's log or its saved config: the config's secrets are remembered, every handler of the root logger redacts,
    and the run folder's `.hydra/` (config.yaml, overrides.yaml, hydra.yaml, as Hydra saves them where
    hydra.output_subdir is set) is written here, redacted (conf/config.yaml sets output_subdir null so that Hydra
    writes no copy with them)."""
    from hydra.core.hydra_config import HydraConfig

    redact_logs(logging.getLogger())
    escape_console(logging.getLogger())  # a console log line may quote a row's id: escaped
    hydra_cfg = HydraConfig.get()
    remember_secrets(OmegaConf.to_container(cfg, resolve=False))
    saved = Path(hydra_cfg.runtime.output_dir) / ".hydra"
    saved.mkdir(parents=True, exist_ok=True)
    files = {"config.yaml": cfg, "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
             "overrides.yaml": OmegaConf.create(list(hydra_cfg.overrides.task))}
    for name, node in files.items():
        clean = OmegaConf.create(redact(OmegaConf.to_container(node, resolve=False)))
        (saved / name).write_text(redact_text(OmegaConf.to_yaml(clean)))


def _to_log_file(level: int, message: str) -> None:
    """`message` into the run's log file only (Hydra's file handler): for what the CLI prints to the console itself."""
    record = log.makeRecord(log.name, level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _entries(directory: Path) -> Optional[set[str]]:
    """The names in `directory`; None where it does not exist."""
    try:
        return set(os.listdir(directory))
    except FileNotFoundError:
        return None


def _forget_refused_run(*, other_writer: bool = False) -> None:
    """A job refused at start (exit 2: config, input, a refused resume, another job's output, a live writer) writes
    nothing into output_dir: Hydra made this run's log folder (`_logs/<time>`, and output_dir itself where it was
    new) before the job's own checks ran; both go again, and `_logs` where it is left empty. Kept where the job
    wrote a file beside the logs that was not there before, or where hydra.run.dir is the user's own place; refused
    by a live writer (`other_writer`), the new files beside the logs are that writer's, and this run's logs go."""
    if invocation.logs_home is None:
        return
    home, before = invocation.logs_home
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    wrote = set() if other_writer else (_entries(home) or set()) - {LOGS} - (before or set())
    if run_dir.parent != home / LOGS or wrote:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for directory in (home / LOGS, home) if before is None else (home / LOGS,):
        with contextlib.suppress(OSError):  # not empty: another run's logs, or another run started there meanwhile
            directory.rmdir()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown (about 3 s with torch loaded, measured on 2 CPU cores): on a stop
    everything durable is already on disk (journal fsynced, status written, lock released)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def preflight(overrides: list[str]) -> JobConfig:
    """Compose and validate the config before Hydra starts the job (and writes output_dir/_logs): every unknown
    key, config problem, missing path or model and unusable output_dir reported at once, one line each, exit 2."""
    try:
        return compose_checked(overrides)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"batchgen: error: {line}", file=sys.stderr)
        sys.exit(2)


def show_job(args: list[str]) -> Optional[int]:
    """`--cfg job` (or `-c job`, with `--resolve` or not): the composed config printed as the job will use it, its
    text keys' `\\n` made newlines as validate makes them (texts.py: compose.shown_yaml); None where `args` ask Hydra
    for anything else."""
    overrides, wanted, resolve, rest = [], False, False, list(args)
    while rest:
        arg = rest.pop(0)
        if arg in ("--cfg", "-c") and rest[:1] == ["job"]:
            wanted, rest = True, rest[1:]
        elif arg == "--cfg=job":
            wanted = True
        elif arg == "--resolve":
            resolve = True
        elif arg.startswith("-"):
            return None
        else:
            overrides.append(arg)
    if not wanted:
        return None
    from batchgen.commands.compose import composed, shown_yaml

    try:
        print(shown_yaml(composed(overrides), resolve), end="")
    except ConfigError as exc:
        for line in exc.problems:
            print(f"batchgen: error: {line}", file=sys.stderr)
        sys.exit(2)
    return 0


# The subcommands, each its own module in commands/ with a main(argv, ...) -> exit code; one line each for --help
COMMANDS = {
    "plan": "what a job would do, before it runs: prompt lengths, rows too long or erring, parts (--calibrate: "
            "rate and ETA)",
    "status": "a run's progress, errors and work in flight, read from OUTPUT_DIR (a killed run's too)",
    "report": "one self-contained HTML page of what a run did",
    "retry": "generate again the rows of a finished job that erred with a retryable kind (too_long, ...)",
    "finalize": "after the shards of a job ran: write _SUCCESS once every part of every shard exists",
    "view": "the latest-attempt view of an output (retried rows in place) as JSON lines, or --to a .parquet/.jsonl; "
            "of a batchgen increment root, its nights' union (each id once)",
    "head": "the first rows of an output (the latest-attempt view): id, finish reason, tokens, the text's start",
    "nightly": "a scheduled job over a fixed input: resume it, or a no-op once it is complete",
    "increment": "a scheduled job over a growing input: a dated output per night, only the new ids generated",
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

Your own presets: DIR/job/NAME.yaml, with --config-dir DIR (any command) or {USER_CONF_ENV}=DIR.
What a key means: batchgen help KEY (dataset.template), or a section (batchgen help sampling); all of them in
docs/configuration.md, "Config reference". `batchgen job=NAME --cfg job` prints
the composed config without running it; `batchgen --hydra-help` shows Hydra's own flags.
Exit codes: 0 done, 1 runtime failure, 2 config or input error, 143/130 stopped by SIGTERM/SIGINT (rerun to resume).
"""


def main() -> None:
    import shlex

    invocation.command = shlex.join(["batchgen", *sys.argv[1:]])
    sys.argv[1:] = take_config_dirs(sys.argv[1:])  # --config-dir DIR: the user's presets, for every command
    first = sys.argv[1] if len(sys.argv) > 1 else None
    if first in ("-h", "--help") or sys.argv[1:] == ["help"]:
        print(usage())
        sys.exit(0)
    if first == "help":  # batchgen help KEY: what a config key means (commands/keys.py)
        from batchgen.commands.keys import main as keys_main

        sys.exit(keys_main(sys.argv[2:]))
    if first in ("-V", "--version"):
        from batchgen.version import __version__

        print(f"batchgen {__version__}")
        sys.exit(0)
    if first in COMMANDS:  # each its own module; plan and retry are handed the config composition they need
        import importlib

        command = importlib.import_module(f"batchgen.commands.{first}")
        handed = {"plan": (compose_checked,), "retry": (config_from,), "nightly": (run_as_job, invocation.command),
                  "increment": (compose_checked, run_as_job)}.get(first, ())
        try:
            code = command.main(sys.argv[2:], *handed)
            sys.stdout.flush()
        except BrokenPipeError:  # `batchgen view OUT | head`: the reader had enough; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = 0
        sys.exit(code)
    sys.exit(run_as_job(sys.argv[1:]))


def run_as_job(args: list[str], advice: Optional[Advice] = None) -> int:
    """`batchgen ARGS` run as a job: checked first (preflight), under hydra.main (its run folder in output_dir/_logs),
    the summary printed, the contract's exit codes. Also how a command runs the job it made (nightly, increment),
    whose `advice` may add a line to the job's error. Returns 0 once the job is done (or complete already); any
    other outcome exits with its code."""
    invocation.advice = advice
    shown = show_job(args)
    if shown is not None:
        return shown
    sys.argv[1:] = args
    if not any(arg.startswith("-") for arg in sys.argv[1:]):  # Hydra's own flags (--help, -m) go straight to it
        cfg = preflight(sys.argv[1:])
        home = RemoteOutput(cfg.output_dir).staging if is_remote(cfg.output_dir) else Path(cfg.output_dir)
        if is_remote(cfg.output_dir) and not any(a.startswith("hydra.run.dir=") for a in sys.argv):
            # Hydra's logs are local files: for an output on object storage, in its staging directory
            sys.argv.append(f"hydra.run.dir={home}/{LOGS}/" + "${now:%Y-%m-%d_%H-%M-%S-%f}")
        invocation.logs_home = (home.resolve(), _entries(home))  # before Hydra makes its run folder there
    sys.argv[1:] = with_search_path(sys.argv[1:])
    try:
        _hydra_main()
    except SystemExit as exc:
        if exc.code not in (0, None) and not invocation.entered_job:
            sys.exit(2)  # Hydra could not compose the config: an unknown key, group or value
        raise
    return 0
