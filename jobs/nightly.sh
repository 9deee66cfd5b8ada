#!/usr/bin/env bash
# A nightly run of a batchgen job, as cron or a systemd timer runs it:
#
#   30 2 * * *  /path/to/batchgen/jobs/nightly.sh annotate dataset.path=/data/today.parquet
#
# The job resumes where a previous night's run stopped, and a finished job is a no-op (exit 0). The exit code tells
# the scheduler what happened (docs/contract.md section 7): 0 done, 1 failed (rerun resumes), 2 a config or input
# error (fix it first), 130/143 stopped by a signal (rerun resumes). The run's output goes to a log beside the
# output directory's own _logs/, and `batchgen status` is printed at the end either way.
set -uo pipefail

job="${1:?usage: nightly.sh JOB [key=value ...]}"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the interpreter: BATCHGEN_PYTHON, else the checkout's own venv (cron's PATH has none), else python3 on PATH
python="${BATCHGEN_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$here/.venv/bin/python" ]; then python="$here/.venv/bin/python"
  else python="$(command -v python3 || command -v python || true)"; fi
fi
if [ -z "$python" ] || ! "$python" -c "import batchgen" 2>/dev/null; then
  echo "nightly $job: no Python with batchgen installed (tried ${python:-python3 on PATH}); set BATCHGEN_PYTHON to" \
       "the interpreter of the environment batchgen is installed in, or run 'make venv' in $here. Not run." >&2
  exit 2
fi
log_dir="${BATCHGEN_LOG_DIR:-$here/data/outputs/nightly-logs}"
mkdir -p "$log_dir"
log="$log_dir/$job-$(date +%Y%m%d-%H%M%S).log"

cd "$here"
"$python" -m batchgen "job=$job" run.progress=false "$@" >"$log" 2>&1
code=$?
out="$(sed -n 's/^batchgen: [a-z ]*: //p' "$log" | head -1)"  # the summary's first line names the output
case $code in
  0) echo "nightly $job: $(grep -m1 '^batchgen: ' "$log" | sed 's/^batchgen: //')" ;;
  2) echo "nightly $job: config or input error, not retried: $(grep -m1 'error' "$log")" >&2 ;;
  130|143) echo "nightly $job: stopped by a signal; the next run resumes" >&2 ;;
  1) echo "nightly $job: failed (exit 1); the next run resumes where this one stopped. Log: $log" >&2 ;;
  *) echo "nightly $job: exited $code, not one of batchgen's codes (the command itself did not run as meant);" \
       "the next run will fail the same way until that is fixed. Log: $log" >&2 ;;
esac
if [ -n "$out" ]; then "$python" -m batchgen status "$out" || true; fi
exit $code
