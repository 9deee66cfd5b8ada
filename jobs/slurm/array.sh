#!/usr/bin/env bash
# A batchgen job as a Slurm array: one task per shard, each reading only its own parts (a Parquet input is cut
# into parts from its footers), resumable, requeued on preemption. Submit as is, or with your own job and size:
#
#   sbatch --array=0-7 jobs/slurm/array.sh job=annotate dataset.path=/data/tickets engine.model=/models/qwen
#   sbatch --dependency=afterany:<array job id> jobs/slurm/finalize.sh /path/to/output_dir
#
# run.shard and run.num_shards come from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT (batchgen reads them when
# they are not set). Preemption: Slurm sends SIGTERM; batchgen journals what is finished and exits 143, and the
# task is requeued (--requeue) to resume where it stopped. The last task to finish writes _SUCCESS; finalize.sh
# checks every part and names any that are missing.
#SBATCH --job-name=batchgen
#SBATCH --requeue
#SBATCH --signal=B:TERM@120
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --output=batchgen-%A_%a.log
set -uo pipefail

BATCHGEN=${BATCHGEN:-batchgen}
$BATCHGEN "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM  # forward the preemption signal; batchgen stops within seconds
wait "$child"
code=$?
if [ "$code" -eq 143 ] && [ -n "${SLURM_JOB_ID:-}" ] && command -v scontrol >/dev/null; then
  scontrol requeue "${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"  # resume on another node
fi
exit "$code"
