#!/usr/bin/env bash
# The CUDA checks in one command on the lent GPU machine (the device tool; docs/engines.md "GPU (CUDA)"), within
# BUDGET_S seconds in all (default 420, 7 minutes), in this order: install the carried wheels; the GPU tier
# (pytest -m gpu); the throughput benchmark's E (a batchgen job) and B2 (transformers continuous batching) at the
# llama-3.2-1b shape, 256 rows, greedy then --sampling; E greedy at 2048 rows if time allows; the decode step of
# 256 rows against its bandwidth bound (benchmarks/decode_step.py). nvidia-smi samples GPU use every 0.5 s meanwhile.
# Each step runs under a timeout cut to what is left of the budget (keeping time for the decode step), and is skipped
# when too little is left; everything is written under $OUT as it goes, so a run cut off still returns its figures.
# Prepare here first:   bash scripts/gpu_wheels.sh          (.whl/, about 55 MB with bitsandbytes)
# Then, with the device tool:  run  command="bash scripts/gpu_check.sh"  carry=[".whl"]  timeout_s=480
# Check here, on CPU at tiny sizes (the same sequence; nvidia-smi and the wheels skipped, the GPU tier skips):
#   bash scripts/gpu_check.sh --dry-run      (or DEVICE=cpu bash scripts/gpu_check.sh)
# Writes under $OUT (8 files at most come back): gpu_check.log (everything, the environment first), gpu_tests.log,
# figures.json (the GPU tests' figures), gpu_util.csv (timestamp, utilization, memory used), throughput-256-greedy.json,
# throughput-256-sampling.json, throughput-2048-greedy.json (each run's medians), decode_step.log.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
[ "${1:-}" = "--dry-run" ] && DEVICE=cpu
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${BUDGET_S:-420}
started=$(date +%s)
exec > >(tee "$OUT/gpu_check.log") 2>&1
logger=$!
if [ "$DEVICE" = cpu ]; then  # the dry run: tiny sizes, the checkout's virtualenv where there is one
  SHAPE=tiny ROWS=16 MANY=64 DECODE_ROWS=8 PY=${PYTHON:-python3}
  [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
  export PYTHONPATH=$PWD
else
  SHAPE=llama-3.2-1b ROWS=256 MANY=2048 DECODE_ROWS=256 PY=${PYTHON:-python3}
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: the wheels did not install (run scripts/gpu_wheels.sh and carry .whl)"; exit 2; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 BATCHGEN_GPU_FIGURES=$OUT/figures.json BATCHGEN_CACHE_DIR=/tmp/batchgen-cache

elapsed() { echo $(( $(date +%s) - started )); }
left() { echo $(( started + BUDGET_S - $(date +%s) )); }
# step NAME MIN CAP RESERVE CMD...: CMD under a timeout of CAP seconds, cut to what the budget leaves after RESERVE
# seconds kept for later steps; skipped when that is under MIN. Its output goes to the log (and to $STEP_LOG if set).
step() {
  local name=$1 min=$2 cap=$3 reserve=$4 limit rc
  shift 4
  limit=$(( $(left) - reserve ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt "$min" ]; then
    echo "== $name: skipped at $(elapsed) s ($(left) s of the budget left, $min s needed)"
    return 0
  fi
  echo "== $name: up to $limit s, from $(elapsed) s ($(date +%T))"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "${STEP_LOG:-/dev/null}"
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc$([ "$rc" = 124 ] && echo ' (timed out)') at $(elapsed) s"
}

{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import sys, torch, transformers, batchgen; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'device',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; } 2>&1
echo "gpu_check: device $DEVICE, shape $SHAPE, $ROWS rows (then $MANY), budget $BUDGET_S s"
# the benchmark model and workloads, built in the background while the GPU tier runs (the benchmarks wait for it)
timeout 300 $PY - "$SHAPE" "$ROWS" "$MANY" >/tmp/gpu_check_build.log 2>&1 <<'EOF' &
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
import throughput

for rows in sys.argv[2:]:
    throughput.build(Path(".bench"), size=sys.argv[1], rows=int(rows), seed=0)
EOF
builder=$!

# the GPU tier: every test marked gpu (tests/engines/test_gpu.py and the CUDA tests beside the CPU ones)
STEP_LOG=$OUT/gpu_tests.log step "gpu tests" 30 150 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests
echo "== waiting for the benchmark model ($(elapsed) s)"
wait "$builder" || { echo "gpu_check: building the benchmark model failed:"; tail -20 /tmp/gpu_check_build.log; }

sampler=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 >"$OUT/gpu_util.csv" &
  sampler=$!
fi
DECODE_RESERVE=70  # what the decode step needs at the end
TP=($PY benchmarks/throughput.py --device "$DEVICE" --shape "$SHAPE" --repeats 1 --workdir .bench)
step "E,B2 greedy, $ROWS rows" 60 150 $(( DECODE_RESERVE + 60 )) "${TP[@]}" --rows "$ROWS" --runners E,B2 \
  --json "$OUT/throughput-$ROWS-greedy.json"
step "E,B2 sampling, $ROWS rows" 60 130 "$DECODE_RESERVE" "${TP[@]}" --rows "$ROWS" --runners E,B2 --sampling \
  --no-engine-alone --json "$OUT/throughput-$ROWS-sampling.json"
step "E greedy, $MANY rows" 45 120 "$DECODE_RESERVE" "${TP[@]}" --rows "$MANY" --runners E --no-engine-alone \
  --json "$OUT/throughput-$MANY-greedy.json"
STEP_LOG=$OUT/decode_step.log step "decode step, $DECODE_ROWS rows" 20 120 0 $PY benchmarks/decode_step.py \
  --device "$DEVICE" --shape "$SHAPE" --rows "$DECODE_ROWS" --steps 16 --rounds 1 --configs none
[ -n "$sampler" ] && kill "$sampler"
echo "gpu_check: done in $(elapsed) s"
exec >&- 2>&-
wait "$logger"  # the log's last lines written before the command returns
