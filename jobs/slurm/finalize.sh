#!/usr/bin/env bash
# After every array task: write _SUCCESS once every part of every shard exists, or name the missing parts (exit 1).
#   sbatch --dependency=afterany:<array job id> jobs/slurm/finalize.sh OUTPUT_DIR
#SBATCH --job-name=batchgen-finalize
#SBATCH --time=00:10:00
set -euo pipefail
exec ${BATCHGEN:-batchgen} finalize "$1"
