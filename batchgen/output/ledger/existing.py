"""Nightly increments (run.skip_existing=PATH): the ids a chain of earlier outputs already generated, so that a job
over yesterday's rows plus today's generates only today's.

PATH is the newest earlier night; its manifest records the night before it (its own run.skip_existing), and so on:
the chain is followed to its first night, so that a row generated three nights ago and skipped since is not
generated again. An id counts as generated when some night of the chain holds it with no erring sample (read
through that night's latest-attempt view); rows that erred everywhere are generated again. Every night of the chain
must be finished (`_SUCCESS`), made under the same output config (the input aside) and by the same model (its
manifest's weight digests): otherwise the job is refused (exit 2), naming the night and why. A night that no longer
exists (a retention policy removed it) ends the chain, with a warning: its rows are generated again, once.

PATH the folder that holds the job's own output_dir (a `batchgen increment` root, ROOT/YYYY-MM-DD): the ledger is
every finished night under it whatever its date, found where the root is now (output/ledger/nights.py); a night a live
process writes is refused (exit 2), an unfinished one passed over with a warning. Ids must be stable: without
dataset.id_column (ids are positions `<file>:<row>`) the job is refused unless run.skip_by_position says so.

Only each night's `id` and `error` columns are read (pyarrow's column projection), and ids are kept as 8-byte hashes
(about 40 bytes a row in a Python set; 10 million rows: about 400 MB). The union of a chain's outputs, each id once,
is the query in docs/output-and-resume.md ("Nightly increments"). Knows Parquet outputs and manifests, not engines.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from batchgen.errors import ConfigError, LockedError
from batchgen.output.ledger.nights import finished, id_hash, nights, writers
from batchgen.output.manifest import MANIFEST, diff, model_identity, nights_beside, output_config, read_manifest
from batchgen.output.rows.schema import SUCCESS

log = logging.getLogger(__name__)
INPUT_KEYS = ("path", "limit")  # dataset keys that may differ between nights: the input itself
MAX_CHAIN = 100_000  # nights; a longer chain is a cycle (a manifest edited by hand)


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """An output config without what names the input (dataset.path, dataset.limit) or the chain itself."""
    out = json.loads(json.dumps(config, default=str))
    for key in INPUT_KEYS:
        out.get("dataset", {}).pop(key, None)
    out.get("run", {}).pop("skip_existing", None)
    return out


def positions_problem(cfg: Any, what: str) -> Optional[str]:
    """Why `what` (run.skip_existing, batchgen increment) cannot skip rows by id: ids that are positions
    `<file>:<row>` (no dataset.id_column), unless run.skip_by_position says so (then warned); None where it can."""
    if cfg.dataset.id_column is not None:
        return None
    if cfg.run.skip_by_position:
        log.warning("%s: dataset.id_column is not set and run.skip_by_position=true: each row's id is its position "
                    "<file>:<row>; a row moved, removed or inserted before others shifts the ids, and rows are then "
                    "skipped or generated again by mistake", what)
        return None
    return (f"{what}: dataset.id_column is not set, so each row's id is its position `<file>:<row>`; a table "
            f"rewritten in another order (or with a row removed) would have new rows skipped as generated and old "
            f"rows generated again. Set dataset.id_column to the input column that names each row (a ticket id), or "
            f"run.skip_by_position=true if the input only ever grows by rows appended at the end of its files")


class Existing:
    """The generated ids (hashed) of run.skip_existing's output and of every earlier night of its chain."""

    def __init__(self, path: str, cfg: Any):
        if "://" in path:
            raise ConfigError([f"run.skip_existing={path}: an earlier output on object storage is not read yet; "
                               f"point run.skip_existing at a local or mounted copy of it"])
        problem = positions_problem(cfg, f"run.skip_existing={path}")
        if problem:
            raise ConfigError([problem])
        self.config = comparable(output_config(cfg))
        self.model = json.loads(json.dumps(model_identity(cfg.engine.model, cfg.engine.tokenizer), default=str))
        ledger = nights_beside(path, str(cfg.output_dir)) and not Path(path, MANIFEST).is_file()
        self.chain = self._ledger(Path(path), Path(cfg.output_dir)) if ledger else self._chain(os.path.realpath(path))
        self.ids: set[int] = set()
        for night in self.chain:
            self.ids |= self._generated(night)
        log.info("run.skip_existing: %d ids generated in %d earlier night(s)%s", len(self.ids), len(self.chain),
                 f", newest {self.chain[0]}" if self.chain else "")

    def _ledger(self, root: Path, own: Path) -> list[str]:
        """Every finished night under `root` but the job's own (`own`), whatever its date, each checked; newest
        first. A night a live process writes is refused; an unfinished one is passed over, its rows generated again."""
        busy = writers(root, but=own)
        if busy:
            raise LockedError(f"run.skip_existing={root}: {', '.join(busy)} is being written now, so the ids it "
                              f"generates are not known yet; run this night once it has finished (batchgen "
                              f"increment --wait waits for it)")
        chain = []
        for night in (n for n in nights(root) if n.name != own.name):
            manifest = read_manifest(night)
            if manifest is None or not finished(night):
                log.warning("run.skip_existing: %s is unfinished (no %s): passed over, its rows are generated again "
                            "tonight", night, SUCCESS)
                continue
            self._check(str(night), manifest, named_by=None)
            chain.append(str(night))
        return chain[::-1]

    def _chain(self, newest: str) -> list[str]:
        """The nights from `newest` back to the first, each checked; newest first."""
        chain: list[str] = []
        path: Optional[str] = newest
        while path is not None:
            if path in chain or len(chain) >= MAX_CHAIN:
                raise ConfigError([f"run.skip_existing: the chain of earlier outputs loops at {path}; fix the "
                                   f"manifests' run.skip_existing or start a new chain"])
            manifest = read_manifest(path) if os.path.isdir(path) else None
            if manifest is None:
                if not chain:
                    raise ConfigError([f"run.skip_existing: {path} holds no batchgen output (no {MANIFEST})"])
                log.warning("run.skip_existing: %s (named by %s) no longer holds an output; the chain ends there and "
                            "the ids it generated are generated again", path, chain[-1])
                break
            self._check(path, manifest, named_by=chain[-1] if chain else None)
            chain.append(path)
            path = (manifest.get("output_config", {}).get("run") or {}).get("skip_existing")
        return chain

    def _check(self, path: str, manifest: dict[str, Any], named_by: Optional[str]) -> None:
        where = f"{path} (named by {named_by}'s manifest)" if named_by else path
        if not Path(path, SUCCESS).is_file():
            raise ConfigError([f"run.skip_existing: {where} is not finished (no {SUCCESS}): its job is running, or "
                               f"was killed; rerun that job to finish it (batchgen status {path}), then this one"])
        changes = diff({"output_config": comparable(manifest.get("output_config", {}))},
                       {"output_config": self.config})
        if changes:
            raise ConfigError([f"run.skip_existing: {where} was generated under another output config ("
                               f"{'; '.join(changes[:5])}); its rows would not be what this job generates. Point it "
                               f"at an output of the same job, or leave it unset"])
        model = diff({"model": manifest.get("model")}, {"model": self.model})
        if model:
            raise ConfigError([f"run.skip_existing: {where} was generated by another model at "
                               f"engine.model ({'; '.join(model[:3])}); its rows would not be what this model "
                               f"generates. Start a new chain (leave run.skip_existing unset) for the new model"])

    @staticmethod
    def _generated(night: str) -> set[int]:
        """Ids with no erring sample in the night's latest-attempt view (batchgen retry's attempts)."""
        from batchgen.output.view import latest_batches

        seen: set[int] = set()
        erred: set[int] = set()
        try:
            batches = latest_batches(night, columns=["id", "error"])
            for batch in batches:
                for row_id, error in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                    (erred if error is not None else seen).add(id_hash(row_id))
        except FileNotFoundError:  # an empty input's night: no part, nothing generated
            return set()
        return seen - erred

    def __contains__(self, row_id: str) -> bool:
        return id_hash(row_id) in self.ids

    def __len__(self) -> int:
        return len(self.ids)
