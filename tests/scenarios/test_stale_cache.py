"""What run.cache_dir and a resume trust about the model and the cache's own entries. A checkpoint updated in place
(its tensors rewritten, the file's size and every sampled block as they were) is another model: no answer of the
old one is served, and a resume into the old model's output is refused naming the weight file. A cache entry whose
digest checks but whose fields are not an answer's (a foreign writer of a shared cache dir) is a logged miss, is
generated again and rewritten; the job writes what a job without the cache writes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from batchgen.errors import ResumeMismatchError
from batchgen.output.manifest import check_or_write, diff, model_identity
from batchgen.run.runner import run_job
from tests.conftest import compose_job, job_overrides, read_output, write_jsonl
from tests.scenarios.test_response_cache import ROWS, generations, night


def sampled_offsets(size: int, blocks: int, block: int) -> list[tuple[int, int]]:
    step = (size - block) / (blocks - 1)
    return [(int(i * step), int(i * step) + block) for i in range(blocks)]


def rewrite_between_blocks(model: Path, blocks: int, block: int) -> None:
    """Every float32 weight whose bytes lie between the sampled blocks scaled by 1.5, in place: the file's size,
    header and every sampled block as they were (a fine-tune that rewrote most of each tensor)."""
    import numpy as np

    file = model / "model.safetensors"
    raw = bytearray(file.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    sampled = sampled_offsets(len(raw), blocks, block)
    for name, info in json.loads(raw[8:header_end]).items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32"
        start, end = (header_end + o for o in info["data_offsets"])
        values = np.frombuffer(bytes(raw[start:end]), dtype="<f4").copy()
        keep = np.zeros(values.size, bool)
        for s, e in sampled:  # the elements a sampled block touches keep their bytes
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                keep[(lo - start) // 4:(hi - start + 3) // 4] = True
        values[~keep] *= 1.5
        raw[start:end] = values.tobytes()
    with open(file, "r+b") as f:
        f.write(raw)


def test_a_checkpoint_rewritten_in_place_between_the_sampled_blocks_is_another_model(tiny_model, tmp_path,
                                                                                      monkeypatch):
    import batchgen.fsutil as fsutil

    monkeypatch.setattr(fsutil, "FULL_DIGEST_BYTES", 1 << 10)  # the tiny checkpoint sampled, as a 15 GB one is
    monkeypatch.setattr(fsutil, "SAMPLE_BLOCK_BYTES", 16)
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    data, cache = write_jsonl(tmp_path / "in.jsonl", night("thu")), tmp_path / "cache"

    def job(out: str, *extra: str):
        return run_job(compose_job(job_overrides(str(model), data, tmp_path / out, "dataset.id_column=id",
                                                 "sampling.max_new_tokens=8", *extra)))

    job("old", f"run.cache_dir={cache}")
    old = model_identity(str(model))
    rewrite_between_blocks(model, fsutil.SAMPLE_BLOCKS, fsutil.SAMPLE_BLOCK_BYTES)
    new = model_identity(str(model))
    assert old["weights"][0]["digest"] == new["weights"][0]["digest"]  # the sampled digest cannot see it
    cached = job("cached", f"run.cache_dir={cache}")
    job("fresh")
    assert cached.cache.hits == 0 and generations(tmp_path / "cached") == generations(tmp_path / "fresh")
    assert generations(tmp_path / "cached") != generations(tmp_path / "old")  # the edit changed the answers
    assert diff({"model": old}, {"model": new}) == [
        f"model.weights[0].sha256: was {old['weights'][0]['sha256']!r}, now {new['weights'][0]['sha256']!r}"]
    manifest = json.loads((tmp_path / "old" / "_manifest.json").read_text())
    with pytest.raises(ResumeMismatchError, match=r"model\.weights\[0\]\.sha256"):
        check_or_write(tmp_path / "old", dict(manifest, model=new))


def test_a_manifest_written_before_the_whole_file_digest_resumes_on_the_digests_it_holds(tiny_model):
    new = model_identity(tiny_model)
    old = {**new, "weights": [{k: v for k, v in w.items() if k != "sha256"} for w in new["weights"]]}
    assert diff({"model": old}, {"model": new}) == []
    changed = {**old, "weights": [dict(old["weights"][0], digest="sampled:00")]}
    assert diff({"model": changed}, {"model": new})  # what it recorded is still compared


def test_the_whole_file_digest_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    import hashlib

    from batchgen.fsutil import cache_home, file_sha256

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"a" * 4096)
    reads = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: reads.append(1) or real(f, name))
    first = file_sha256(weights)
    assert file_sha256(weights) == first == hashlib.sha256(b"a" * 4096).hexdigest() and len(reads) == 1
    kept = next((cache_home() / "digests").glob("*.json"))
    kept.write_text(json.dumps({"key": json.loads(kept.read_text())["key"], "sha256": "0" * 63}))  # foreign
    assert file_sha256(weights) == first and len(reads) == 2  # computed again, and rewritten
    assert file_sha256(weights) == first and len(reads) == 2
    with open(weights, "r+b") as f:  # in place, same size
        f.write(b"b")
    assert file_sha256(weights) == hashlib.sha256(b"b" + b"a" * 4095).hexdigest() and len(reads) == 3


WRONG = [("text", 123), ("num_generated_tokens", "x"), ("finish_reason", None), ("num_prompt_tokens", -4),
         ("num_generated_tokens", 2**40), ("token_logprobs", [float("nan")]), ("reasoning", 5)]


def test_a_cache_entry_with_a_valid_digest_and_wrong_fields_is_a_logged_miss_and_is_rewritten(tiny_model, tmp_path,
                                                                                              caplog):
    from batchgen.run.respcache import _digest

    data, cache = write_jsonl(tmp_path / "in.jsonl", night("fri")), tmp_path / "cache"

    def job(out: str, *extra: str):
        return run_job(compose_job(job_overrides(tiny_model, data, tmp_path / out, "dataset.id_column=id",
                                                 "sampling.max_new_tokens=8", *extra)))

    job("first", f"run.cache_dir={cache}")
    entries = sorted(cache.rglob("*.json"))
    for file, (field, value) in zip(entries, WRONG):  # each re-signed: the digest is a checksum, not a MAC
        entry = json.loads(file.read_text())
        entry["result"][field] = value
        entry["digest"] = _digest(entry["result"])
        file.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="batchgen.run.respcache"):
        second = job("second", f"run.cache_dir={cache}")
    assert second.state == "done" and second.cache.stored == len(WRONG)
    assert second.cache.hits + second.cache.deduplicated == ROWS - len(WRONG)
    warned = [r.getMessage() for r in caplog.records if "run.cache_dir" in r.getMessage()]
    assert len(warned) == len(WRONG) and all(f"its {field} is" in " ".join(warned) for field, _ in WRONG)
    third = job("third", f"run.cache_dir={cache}")
    assert third.cache.hits == ROWS - third.cache.deduplicated and third.cache.stored == 0  # rewritten whole
    job("plain")
    rows = {out: sorted(read_output(tmp_path / out).to_pylist(), key=lambda r: r["id"])
            for out in ("second", "third", "plain")}
    assert rows["second"] == rows["third"] == rows["plain"]
