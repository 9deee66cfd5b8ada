#!/usr/bin/env bash
# The CUDA checks of issue "The CUDA paths, run for real", in one command on the lent GPU machine (the device tool,
# docs/engines.md "GPU (CUDA)"): install the carried wheels, run the GPU test tier, then the throughput benchmark on CUDA.
# Prepare here first:   bash scripts/gpu_wheels.sh          (.whl/, about 48 MB)
# Then, with the device tool:  run  command="bash scripts/gpu_check.sh"  carry=[".whl"]  timeout_s=560
# Writes under $OUT: gpu_check.log (everything), gpu_tests.log, figures.json (the tests' figures), throughput.json,
# throughput.log, env.txt. Budget: about 8 minutes (tests ~3, benchmark ~4).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
exec > >(tee "$OUT/gpu_check.log") 2>&1
started=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_check: the wheels did not install (run scripts/gpu_wheels.sh and carry .whl)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BATCHGEN_GPU_FIGURES=$OUT/figures.json
export BATCHGEN_CACHE_DIR=/tmp/batchgen-cache
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, batchgen; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name())"; } | tee "$OUT/env.txt"
# the GPU tier: every test marked gpu (tests/engines/test_gpu.py and the CUDA tests beside the CPU ones)
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log"
echo "gpu tests: exit ${PIPESTATUS[0]} after $(( $(date +%s) - started )) s"
# throughput on CUDA: the 76M benchmark model, 256 rows, B1 (HF generate, batches of 16), B2 (transformers
# continuous batching) and E (a batchgen job), interleaved, 2 repeats
timeout 270 python3 benchmarks/throughput.py --device cuda --rows 256 --repeats 2 --runners B1,B2,E \
  --workdir /tmp/bench --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log"
echo "gpu_check: done in $(( $(date +%s) - started )) s"
