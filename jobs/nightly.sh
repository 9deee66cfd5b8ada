#!/usr/bin/env bash
# Example: a scheduled batchgen job over a FIXED input, as cron or a systemd timer runs it. `batchgen nightly` does
# the work (docs/scheduled-jobs.md): a complete output is a no-op (exit 0), a killed run's output is resumed, and an
# input that changed under the output is refused (exit 2; a job over a growing input wants `batchgen increment`,
# jobs/increment.sh). This script only finds the interpreter that cron's bare environment lacks
# (jobs/run-batchgen.sh), then runs
#   batchgen nightly [--config-dir DIR] job=NAME [key=value ...]
# in the directory it is started in, where the job's relative paths resolve. The crontab line (crontab -e):
#
#   30 2 * * *  cd /srv/annotate && /path/to/jobs/nightly.sh --config-dir presets job=annotate >>nightly.log 2>&1
#
# Exit codes (the job's own, docs/contract.md section 7): 0 done or nothing to do, 1 a failure (the next run
# resumes), 2 a config or input problem (fix it first), 130/143 stopped by a signal (the next run resumes).
set -uo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/run-batchgen.sh" nightly.sh nightly "$@"
