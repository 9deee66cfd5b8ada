"""Exceptions that carry what a user needs to act on; the CLI maps them to exit codes (docs/contract.md section 7)."""

from __future__ import annotations

from batchgen.redact import redact_text


class BatchgenError(Exception):
    """Base class: every batchgen error the CLI knows how to report. Its text, wherever it is shown or written (the
    console, the log, _status.json), has every URL's user, password and query values masked (redact.py)."""

    exit_code = 1
    resumable = True  # a runtime failure that the same command, run again, resumes past

    def __str__(self) -> str:
        return redact_text(super().__str__())


class ConfigError(BatchgenError):
    """One or more config problems, each naming the key as the user types it."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        self.problems = [redact_text(str(p)) for p in problems]
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in self.problems))


class InputError(BatchgenError):
    """The input cannot be read at all (missing file, corrupt Parquet, missing column)."""

    exit_code = 2


class ResumeMismatchError(BatchgenError):
    """output_dir holds a run whose input or output-affecting config differs from this one; `changes` says what
    differs, one line each as the manifest's diff words it (`input[0].size: was 10, now 12`), where it is known;
    `output_dir` the refused output, as the job named it, where known."""

    exit_code = 2

    def __init__(self, message: str, changes: tuple[str, ...] = (), output_dir: str = ""):
        super().__init__(message)
        self.changes = tuple(changes)
        self.output_dir = output_dir


class LockedError(BatchgenError):
    """Another live process holds the output_dir lock."""

    exit_code = 2


class ErrorRateExceeded(BatchgenError):
    """More than run.max_error_rate of the rows so far recorded errors."""

    exit_code = 1

    def __init__(self, message: str, *, resumable: bool = True):
        super().__init__(message)
        self.resumable = resumable  # False: the errors are the input's own, and a rerun stops the same way


class TooLongError(BatchgenError):
    """A prompt does not fit under run.too_long=fail."""

    exit_code = 1


class ModelLoadError(BatchgenError):
    """The model directory passed the checks but from_pretrained could not load it (corrupt weights, an
    unsupported architecture, a scheme the device lacks): an input problem, before any generation."""

    exit_code = 2


class BadPartError(BatchgenError):
    """A part-*.parquet in an output directory that batchgen cannot read as its own (truncated, not Parquet, or
    without the columns the committer writes): reading on would crash or silently drop rows."""

    exit_code = 2
