"""How far the job's config travels: a trace of one job, every call of a batchgen function that is handed the job's
config (a JobConfig argument), counted by module, with the folder moves and climbs of that walk.

    python scripts/config_walk.py            # a 40-row engine=dummy job run in-process through the command line

A *visit* is one call of a function that takes the config (the config's own methods, where it is `self`, are not
counted). A *move* is a visit in another folder of batchgen/ than
the visit before it. A *climb* is a return from such a call into a caller in another folder that takes the config
too, before the walk goes on: the config went down into a folder and came back up. Fewer visits, moves and climbs
mean the modules were handed the few typed values they need once, instead of the whole config on every call.
Prints the totals, then the modules by visits.
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PACKAGE = str(ROOT / "batchgen") + os.sep


def folder(filename: str) -> str:
    return os.path.dirname(filename[len(PACKAGE):]) or "."


class Walk:
    def __init__(self, config_type: type):
        self.config_type = config_type
        self.visits: collections.Counter[str] = collections.Counter()
        self.moves = self.climbs = 0
        self.last_folder: str | None = None
        self.stack: list[str | None] = []  # per batchgen frame: its folder where it took the config, else None
        self.climbed: collections.Counter[str] = collections.Counter()  # "from -> to" folders

    def takes_config(self, frame) -> bool:
        code = frame.f_code
        names = [n for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount] if n != "self"]
        return any(isinstance(frame.f_locals.get(n), self.config_type) for n in names)

    def __call__(self, frame, event, arg) -> None:
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE) or event not in ("call", "return"):
            return
        if event == "call":
            here = folder(filename) if self.takes_config(frame) else None
            self.stack.append(here)
            if here is not None:
                self.visits[filename[len(PACKAGE):]] += 1
                self.moves += self.last_folder is not None and here != self.last_folder
                self.last_folder = here
            return
        if not self.stack:
            return
        here = self.stack.pop()
        caller = next((f for f in reversed(self.stack) if f is not None), None)
        if here is not None and caller is not None and caller != here:
            self.climbs += 1
            self.climbed[f"{here} -> {caller} ({frame.f_code.co_name})"] += 1
            self.last_folder = caller


def trace_a_job(work: Path, config_type: type, cli_main, build_model) -> Walk:
    """Build a tiny model and a 40-row input under `work`, then run the job through the command line, traced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    build_model(work / "model", [f"row {i} of the walk" for i in range(50)], size="tiny")
    pq.write_table(pa.table({"prompt": [f"prompt number {i}" for i in range(40)]}), work / "in.parquet")
    walk = Walk(config_type)
    sys.argv = ["batchgen", "name=walk", f"output_dir={work / 'out'}", f"dataset.path={work / 'in.parquet'}",
                "engine=dummy", f"engine.model={work / 'model'}", "run.rows_per_part=8", "run.progress=false"]
    sys.setprofile(walk)
    try:
        cli_main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        sys.setprofile(None)
    return walk


def main() -> None:
    from batchgen.commands import cli
    from batchgen.engines.toymodel import build_model
    from batchgen.job import JobConfig

    with tempfile.TemporaryDirectory(prefix="config-walk-") as tmp:
        walk = trace_a_job(Path(tmp), JobConfig, cli.main, build_model)
    print(f"visits {sum(walk.visits.values())}, modules {len(walk.visits)}, "
          f"folders {len({os.path.dirname(m) for m in walk.visits})}, moves {walk.moves}, climbs {walk.climbs}")
    for module, n in walk.visits.most_common():
        print(f"  {n:4d}  {module}")
    print("climbs (from -> to, the function returning):")
    for edge, n in walk.climbed.most_common():
        print(f"  {n:4d}  {edge}")


if __name__ == "__main__":
    main()
