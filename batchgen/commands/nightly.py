"""`batchgen nightly [--config-dir DIR] job=NAME [key=value ...]`: a scheduled job over a FIXED input (cron, a systemd
timer), one output every night: a complete output is a no-op that says so (exit 0), a killed run's is resumed, and
an input that changed under the same output is refused (exit 2) with what a job over a changing input wants instead,
`batchgen increment` (commands/increment.py). It runs where it is started, like `batchgen job=NAME` (relative paths
resolve in the working directory), and the job's own exit codes are kept (docs/contract.md section 7).

Knows which overrides a scheduled run adds and how to read a refused resume; the job itself runs as the CLI runs any
job (cli.run_as_job, handed in by cli.py, the one place that knows Hydra). docs/scheduled-jobs.md is its page.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Optional

from batchgen.errors import BatchgenError, ResumeMismatchError

Advice = Callable[[BatchgenError], Optional[str]]
RunAsJob = Callable[[list[str], Optional[Advice]], int]  # cli.run_as_job: 0 once done; any other outcome exits
# what a manifest's diff names when the input itself changed: its files' fingerprints, or the path or limit
INPUT_CHANGES = ("input", "output_config.dataset.path", "output_config.dataset.limit")
ABOUT = """A scheduled job over a fixed input, the same output every night: a complete output is a no-op (exit 0), a
killed run's output is resumed, and an input that changed under it is refused (exit 2): a job over a growing input
wants `batchgen increment`. Runs in the working directory, like `batchgen job=NAME`."""
USAGE_TAIL = """
--config-dir DIR (anywhere on the line) names your presets, DIR/job/NAME.yaml. Exit codes: 0 done (or nothing to
do), 1 a failure (the next run resumes), 2 a config or input problem (fix it first: the next run fails the same way),
130/143 stopped by SIGINT/SIGTERM (the next run resumes). The cron line and the systemd timer: docs/scheduled-jobs.md
(in the source repository, with the example jobs/nightly.sh and jobs/increment.sh)."""


def parser(prog: str, about: str) -> argparse.ArgumentParser:
    """The command's argument parser: its overrides as the job takes them, what it does and its exit codes."""
    out = argparse.ArgumentParser(prog=prog, description=about + "\n" + USAGE_TAIL,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("overrides", nargs="*", metavar="key=value",
                     help="job=NAME and the job's config overrides, as `batchgen job=NAME key=value ...` takes them")
    return out


def scheduled(overrides: list[str]) -> list[str]:
    """The overrides a scheduled run adds where the user did not set them: no progress bar (a scheduler's log is no
    terminal; the summary says what the run did)."""
    keys = {arg.split("=", 1)[0].lstrip("+~") for arg in overrides}
    return [*overrides, *([] if "run.progress" in keys else ["run.progress=false"])]


def input_changed(exc: BatchgenError) -> list[str]:
    """The differences of a refused resume that are the input's own (its files, path or limit); empty for any other
    error, or a refusal for another model or config."""
    if not isinstance(exc, ResumeMismatchError):
        return []
    return [change for change in exc.changes if change.startswith(INPUT_CHANGES)]


def advice(typed: str, exc: BatchgenError) -> Optional[str]:
    """What a refused nightly run over a changed input says to do: a job over a changing input wants `batchgen
    increment`, the command as typed (`typed`) with that word in place of `nightly` and an output_dir of its own
    (the refused one's name with -nights), a line that runs as printed."""
    if not input_changed(exc):
        return None
    import shlex

    words = shlex.split(typed)
    at = words.index("nightly") if "nightly" in words else len(words)
    given = [w for w in words[at + 1:] if w.lstrip("+~").split("=", 1)[0] == "output_dir"]
    refused = getattr(exc, "output_dir", "") or (given[-1].split("=", 1)[1] if given else "OUTPUT_DIR")
    kept = [w for w in words[at + 1:] if w not in given]
    again = shlex.join([*words[:at], "increment", *kept, f"output_dir={refused.rstrip('/')}-nights"])
    return ("the job's input changed since its output was made: `batchgen nightly` keeps one output for a fixed "
            "input, and does not start it again over another input. A job over a changing input (a table that gets "
            "new rows) wants `batchgen increment`, a dated output per night under an output_dir of its own, with only "
            f"the new ids generated: {again} (docs/scheduled-jobs.md). A job over a new fixed input wants a new "
            "output_dir")


def main(argv: list[str], run_as_job: RunAsJob, typed: str = "batchgen nightly") -> int:
    """The CLI's `batchgen nightly`: the job as given, run as `batchgen job=NAME` runs it, with advice on a refusal;
    `typed` is the command line as typed (its --config-dir too), for the advice."""
    args = parser("batchgen nightly", ABOUT).parse_args(argv)
    return run_as_job(scheduled(args.overrides), lambda exc: advice(typed, exc))
