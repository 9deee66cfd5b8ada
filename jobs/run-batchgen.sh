#!/usr/bin/env bash
# Shared by jobs/nightly.sh and jobs/increment.sh: `run-batchgen.sh NAME COMMAND [ARGS...]` finds the interpreter that
# cron's bare environment lacks (BATCHGEN_PYTHON, else this checkout's own .venv, else python3 on PATH) and runs
# `python -m batchgen COMMAND ARGS...` in the directory it is started in; exit 2 where no interpreter has batchgen.
set -uo pipefail
name=$1 command=$2
shift 2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${BATCHGEN_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$here/.venv/bin/python" ]; then python="$here/.venv/bin/python"
  else python="$(command -v python3 || true)"; fi
fi
if [ -z "$python" ] || ! "$python" -c "import batchgen" 2>/dev/null; then
  echo "$name: no Python with batchgen installed (tried ${python:-python3 on PATH}); set BATCHGEN_PYTHON to the" \
       "interpreter of the environment batchgen is installed in. Not run." >&2
  exit 2
fi
exec "$python" -m batchgen "$command" "$@"
