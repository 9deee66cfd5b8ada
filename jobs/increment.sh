#!/usr/bin/env bash
# A dataset that grows every night: generate only the rows that are new since the last night's output.
#
#   30 2 * * *  /path/to/batchgen/jobs/increment.sh annotate /data/tickets /data/outputs/annotate
#
# Each night writes OUT_ROOT/YYYY-MM-DD (today, deterministic: a rerun the same day resumes it) with
# run.skip_existing pointing at the newest earlier night that finished (_SUCCESS), so only ids not generated there
# are generated; the chain of earlier nights is followed through their manifests (rows that erred are generated
# again). A reader takes the union of the nights, each id once: the query in docs/output-and-resume.md ("Nightly increments").
# Runs through nightly.sh: same exit codes, log and status.
set -uo pipefail

job="${1:?usage: increment.sh JOB INPUT OUT_ROOT [key=value ...]}"
input="${2:?usage: increment.sh JOB INPUT OUT_ROOT [key=value ...]}"
root="${3:?usage: increment.sh JOB INPUT OUT_ROOT [key=value ...]}"
shift 3
today="${BATCHGEN_TODAY:-$(date +%F)}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
previous=""
for dir in $(ls -d "$root"/????-??-?? 2>/dev/null | sort); do
  [ "$(basename "$dir")" \< "$today" ] && [ -e "$dir/_SUCCESS" ] && previous="$dir"
done
extra=()
[ -n "$previous" ] && extra+=("run.skip_existing=$previous")
exec "$here/nightly.sh" "$job" "dataset.path=$input" "output_dir=$root/$today" "${extra[@]}" "$@"
