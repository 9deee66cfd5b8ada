"""Where a job runs: `launcher=local` (this process, or one shard of an array: run.shard / run.num_shards) or
`launcher=ray` (a driver here, one engine per Ray actor, parts pulled by free workers: ray_job.py). Plain
dataclasses; the job config holds one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LAUNCHERS = ("local", "ray")


@dataclass
class LauncherConfig:
    name: str = "local"  # local | ray (chosen with `launcher=ray`)
    address: Optional[str] = None  # ray: an existing cluster (`ray://host:10001`, `auto`); null: a local one
    num_workers: int = 2  # ray: actors, each loading one engine once
    num_cpus: float = 1  # ray: per worker
    num_gpus: float = 0  # ray: per worker (a GPU worker is pinned to its device by Ray's CUDA_VISIBLE_DEVICES)
    max_attempts: int = 3  # ray: a part whose worker died (or whose engine raised) is requeued, at most this often

    def problems(self) -> list[str]:
        out = []
        if self.name not in LAUNCHERS:
            out.append(f"launcher must be one of {', '.join(LAUNCHERS)} (got {self.name!r})")
        if self.num_workers < 1:
            out.append(f"launcher.num_workers must be >= 1 (got {self.num_workers})")
        if self.num_cpus < 0 or self.num_gpus < 0:
            out.append("launcher.num_cpus and launcher.num_gpus must be >= 0")
        if self.max_attempts < 1:
            out.append(f"launcher.max_attempts must be >= 1 (got {self.max_attempts})")
        if self.name == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                out.append("launcher=ray needs Ray: pip install 'batchgen[ray]'")
        return out
