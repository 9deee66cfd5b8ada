#!/usr/bin/env bash
# Example: a scheduled batchgen job over a GROWING input (a table that gets new rows), as cron or a systemd timer
# runs it. `batchgen increment` does the work (docs/scheduled-jobs.md): each night a dated output under the job's
# output_dir (OUTPUT_DIR/2026-12-06) with only the ids no earlier night generated; a rerun the same night resumes
# that night's output, a no-op once it is complete. This script only finds the interpreter that cron's bare
# environment lacks, then runs
#   batchgen increment [--config-dir DIR] [--date YYYY-MM-DD] job=NAME [key=value ...]
# in the directory it is started in, where the job's relative paths resolve. The crontab line (crontab -e):
#
#   30 2 * * *  cd /srv/annotate && /path/to/jobs/increment.sh --config-dir presets job=annotate >>increment.log 2>&1
#
# Exit codes (the job's own, docs/contract.md section 7): 0 done or nothing new, 1 a failure (the next run resumes),
# 2 a config or input problem (fix it first), 130/143 stopped by a signal (the next run resumes).
set -uo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/run-batchgen.sh" increment.sh increment "$@"
