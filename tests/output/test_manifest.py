"""The manifest on its own: the config hash covers exactly the output-affecting keys, the model is known by its
content, a resume with a different input, model, config or resolved engine is refused naming what changed."""

from __future__ import annotations

import json
import os
import struct

import pytest

from batchgen.engines.hf.config import HFConfig
from batchgen.errors import ResumeMismatchError
from batchgen.job import JobConfig, RunConfig
from batchgen.output.manifest import (
    MANIFEST,
    build_manifest,
    check_engine,
    check_or_write,
    config_hash,
    diff,
    model_identity,
    output_config,
)
from batchgen.reader import DatasetConfig
from batchgen.sampling import SamplingConfig


def fake_model(path, *, header: dict | None = None, data: bytes = b"\x00" * 64, config: dict | None = None):
    """A model directory: config.json and a model.safetensors (8-byte LE header length, JSON header, data)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama", "hidden_size": 8}))
    header = header or {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (path / "tokenizer.json").write_text("{}")
    return path


def job(model: str = "m", data: str = "/data/in.jsonl", **sampling) -> JobConfig:
    return JobConfig(name="t", output_dir="/out", engine=HFConfig(model=model, dtype="float32"),
                     dataset=DatasetConfig(path=data, prompt_column="prompt"), sampling=SamplingConfig(**sampling),
                     run=RunConfig(rows_per_part=8))


def set_key(cfg: JobConfig, dotted: str, value) -> JobConfig:
    obj = cfg
    *parents, last = dotted.split(".")
    for name in parents:
        obj = getattr(obj, name)
    assert hasattr(obj, last), dotted
    setattr(obj, last, value)
    return cfg


# -- config_hash -----------------------------------------------------------------------------------------------


def test_equal_configs_hash_equal():
    assert config_hash(job(temperature=0.5, stop=["x"])) == config_hash(job(temperature=0.5, stop=["x"]))
    assert len(config_hash(job())) == 16


@pytest.mark.parametrize("key, value", [
    ("sampling.temperature", 0.7), ("sampling.max_new_tokens", 17), ("sampling.seed", 1), ("sampling.n", 2),
    ("sampling.top_p", 0.5), ("sampling.top_k", 4), ("sampling.stop", ["###"]), ("sampling.ignore_eos", True),
    ("dataset.prompt_column", "text"), ("dataset.template", "Q: {q}"), ("dataset.system_prompt", "be brief"),
    ("dataset.messages_column", "msgs"), ("dataset.limit", 5), ("dataset.max_new_tokens_column", "cap"),
    ("dataset.id_column", "uid"), ("dataset.max_line_bytes", 100), ("dataset.path", "/data/other.jsonl"),
    ("engine.model", "other-model"), ("engine.quantization", "int8"), ("engine.max_model_len", 64),
    ("engine.tokenizer", "other-tok"), ("run.rows_per_part", 9), ("run.too_long", "skip")])
def test_an_output_affecting_key_changes_the_hash(key, value):
    assert config_hash(set_key(job(), key, value)) != config_hash(job())


@pytest.mark.parametrize("key, value", [
    ("run.progress", False), ("run.shard", 1), ("run.num_shards", 3), ("run.max_error_rate", 0.1),
    ("run.on_bad_row", "fail"), ("run.resume", False), ("dataset.batch_rows", 3), ("engine.dtype", "auto"),
    ("engine.device", "cpu"), ("engine.threads", 2), ("engine.max_batch_size", 3), ("engine.max_batch_tokens", 99),
    ("engine.prepack", False), ("output_dir", "/elsewhere"), ("name", "other")])
def test_a_key_that_does_not_change_the_output_keeps_the_hash(key, value):
    assert config_hash(set_key(job(), key, value)) == config_hash(job())


def test_rows_per_part_is_compared_resolved():
    """run.rows_per_part=null means the engine's default: the same parts as that default set explicitly."""
    default = job()
    default.run.rows_per_part = None
    explicit = job()
    explicit.run.rows_per_part = 256  # engine=hf's default
    assert config_hash(default) == config_hash(explicit)
    assert output_config(default)["run"]["rows_per_part"] == 256


def test_a_model_path_is_compared_resolved(tmp_path, monkeypatch):
    model = fake_model(tmp_path / "model")
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    hashes = {config_hash(job(model=spelling)) for spelling in (str(model), "model", "./model", "link")}
    assert len(hashes) == 1


def test_a_dataset_path_is_compared_resolved(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    monkeypatch.chdir(tmp_path)
    assert config_hash(job(data="in.jsonl")) == config_hash(job(data=str(tmp_path / "in.jsonl")))


# -- model_identity --------------------------------------------------------------------------------------------


def test_model_identity_ignores_mtime_and_path_spelling(tmp_path, monkeypatch):
    model = fake_model(tmp_path / "model")
    before = model_identity(str(model))
    for f in model.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path)
    assert model_identity(str(model)) == model_identity("model") == model_identity("link") == before
    assert before["model"] == os.path.realpath(model)
    (weights,) = before["weights"]
    assert weights["file"] == "model.safetensors" and weights["size"] == (model / "model.safetensors").stat().st_size
    assert weights["header_sha256"] is not None and before["config_sha256"] is not None


def test_model_identity_changes_with_the_weights_bytes(tmp_path):
    """Retrained weights of the same size and header: only the content digest tells, and it does."""
    model = fake_model(tmp_path / "model")
    before = model_identity(str(model))
    fake_model(model, data=b"\x00" * 63 + b"\x01")
    after = model_identity(str(model))
    assert after != before
    assert after["weights"][0]["size"] == before["weights"][0]["size"]
    assert after["weights"][0]["header_sha256"] == before["weights"][0]["header_sha256"]
    assert after["weights"][0]["digest"] != before["weights"][0]["digest"]


def test_model_identity_changes_with_the_safetensors_header(tmp_path):
    model = fake_model(tmp_path / "model")
    before = model_identity(str(model))
    fake_model(model, header={"v": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}})  # same length
    after = model_identity(str(model))
    assert after["weights"][0]["header_sha256"] != before["weights"][0]["header_sha256"]


def test_model_identity_changes_with_config_json(tmp_path):
    model = fake_model(tmp_path / "model")
    before = model_identity(str(model))
    fake_model(model, config={"model_type": "llama", "hidden_size": 16})
    after = model_identity(str(model))
    assert after["config_sha256"] != before["config_sha256"] and after["weights"] == before["weights"]


def test_model_identity_lists_every_weight_file_and_only_those(tmp_path):
    model = fake_model(tmp_path / "model")
    (model / "extra.bin").write_bytes(b"abc")
    (model / "notes.txt").write_text("not weights")
    (model / "tiny.safetensors").write_bytes(b"abc")  # shorter than a header length: no header digest
    ident = model_identity(str(model))
    assert [w["file"] for w in ident["weights"]] == ["extra.bin", "model.safetensors", "tiny.safetensors"]
    assert ident["weights"][0]["header_sha256"] is None and ident["weights"][2]["header_sha256"] is None


def test_a_hub_id_stands_for_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_identity("org/some-model") == {"model": "org/some-model"}


# -- check_or_write, check_engine, diff ------------------------------------------------------------------------

FINGERPRINT = [{"path": "/data/in.jsonl", "size": 10, "digest": "full:aa"}]


def manifest_for(cfg: JobConfig, fingerprint=None, resolved=None) -> dict:
    return build_manifest(cfg, resolved or {"run": {"progress": True}}, fingerprint or FINGERPRINT)


def test_check_or_write_writes_the_manifest_the_first_time(tmp_path):
    cfg = job(model=str(fake_model(tmp_path / "model")))
    manifest = manifest_for(cfg)
    check_or_write(tmp_path, manifest)
    written = json.loads((tmp_path / MANIFEST).read_text())
    assert written == manifest and written["config_hash"] == config_hash(cfg)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # written atomically


def test_the_same_manifest_resumes_and_is_left_as_it_was(tmp_path):
    cfg = job(model=str(fake_model(tmp_path / "model")))
    check_or_write(tmp_path, manifest_for(cfg))
    before = (tmp_path / MANIFEST).read_bytes()
    check_or_write(tmp_path, manifest_for(job(model=str(tmp_path / "model")), resolved={"run": {"progress": 0}}))
    assert (tmp_path / MANIFEST).read_bytes() == before  # the resolved config is recorded, not compared


def test_a_changed_output_key_is_refused_naming_it(tmp_path):
    model = str(fake_model(tmp_path / "model"))
    check_or_write(tmp_path, manifest_for(job(model=model, temperature=0.0)))
    before = (tmp_path / MANIFEST).read_bytes()
    with pytest.raises(ResumeMismatchError, match=r"output_config\.sampling\.temperature: was 0\.0, now 0\.7"):
        check_or_write(tmp_path, manifest_for(job(model=model, temperature=0.7)))
    with pytest.raises(ResumeMismatchError, match=r"output_config\.sampling\.max_new_tokens: was 256, now 5"):
        check_or_write(tmp_path, manifest_for(job(model=model, max_new_tokens=5)))
    assert (tmp_path / MANIFEST).read_bytes() == before


def test_a_changed_input_is_refused_naming_the_file_and_field(tmp_path):
    model = str(fake_model(tmp_path / "model"))
    check_or_write(tmp_path, manifest_for(job(model=model)))
    changed = [dict(FINGERPRINT[0], digest="full:bb")]
    with pytest.raises(ResumeMismatchError, match=r"input\[0\]\.digest: was 'full:aa', now 'full:bb'") as info:
        check_or_write(tmp_path, manifest_for(job(model=model), fingerprint=changed))
    assert "size" not in str(info.value)


def test_changed_model_weights_are_refused(tmp_path):
    model = fake_model(tmp_path / "model")
    check_or_write(tmp_path, manifest_for(job(model=str(model))))
    fake_model(model, data=b"\x07" * 64)
    with pytest.raises(ResumeMismatchError, match=r"model\.weights\[0\]\.digest"):
        check_or_write(tmp_path, manifest_for(job(model=str(model))))


def test_check_engine_records_the_resolved_settings_then_refuses_another_dtype(tmp_path):
    cfg = job(model=str(fake_model(tmp_path / "model")))
    check_or_write(tmp_path, manifest_for(cfg))
    identity = {"engine": "hf", "dtype": "float32", "activations": "float32", "quantization": None,
                "device": "cpu", "version": "1"}
    check_engine(tmp_path, identity)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["engine_resolved"] == {"engine": "hf", "dtype": "float32", "activations": "float32",
                                           "quantization": None, "quantization_scheme": None}
    assert manifest["config_hash"] == config_hash(cfg)  # the rest of the manifest is kept
    check_engine(tmp_path, identity | {"device": "cuda:0", "version": "2"})  # not output-affecting: resumes
    with pytest.raises(ResumeMismatchError, match=r"(?s)engine\.dtype: was 'float32', now 'bfloat16'.*"
                                                  r"engine\.dtype=float32"):
        check_engine(tmp_path, identity | {"dtype": "bfloat16"})
    with pytest.raises(ResumeMismatchError, match=r"engine\.quantization: was None, now 'int8'"):
        check_engine(tmp_path, identity | {"quantization": "int8"})
    assert json.loads((tmp_path / MANIFEST).read_text())["engine_resolved"]["dtype"] == "float32"


def test_int8_written_weight_only_does_not_resume_as_w8a8(tmp_path):
    """An output written with int8 weight-only (an earlier batchgen; or a CPU where W8A8 does not run), whose manifest
    has no quantization_scheme, is not continued by W8A8 int8: its rows would come from other arithmetic."""
    cfg = job(model=str(fake_model(tmp_path / "model")))
    check_or_write(tmp_path, manifest_for(cfg))
    recorded = {"engine": "hf", "dtype": "float32", "activations": "float32", "quantization": "int8"}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps(manifest | {"engine_resolved": recorded}))  # as an older version wrote
    check_engine(tmp_path, recorded | {"device": "cpu"})  # weight-only here too: resumes
    with pytest.raises(ResumeMismatchError, match=r"(?s)engine\.quantization_scheme: was None, now 'w8a8'.*"
                                                  r"engine\.quantization=int8_wo"):
        check_engine(tmp_path, recorded | {"quantization_scheme": "w8a8"})


def test_int4_written_weight_only_does_not_resume_as_w4a8_and_says_how_to(tmp_path):
    """An int4 output written weight-only (an earlier batchgen, or a CPU without avx512_vnni) is not continued by
    W4A8 int4; the message names the way back on a VNNI CPU (the AVX2 kernels run int4 weight-only)."""
    cfg = job(model=str(fake_model(tmp_path / "model")))
    check_or_write(tmp_path, manifest_for(cfg))
    recorded = {"engine": "hf", "dtype": "float32", "activations": "float32", "quantization": "int4"}
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    (tmp_path / MANIFEST).write_text(json.dumps(manifest | {"engine_resolved": recorded}))
    check_engine(tmp_path, recorded | {"device": "cpu"})
    with pytest.raises(ResumeMismatchError, match=r"(?s)engine\.quantization_scheme: was None, now 'w4a8'.*"
                                                  r"W4A8.*BATCHGEN_CPU_ISA=avx2"):
        check_engine(tmp_path, recorded | {"quantization_scheme": "w4a8"})


def test_diff_lists_nested_differences_with_dotted_paths():
    old = {"output_config": {"sampling": {"temperature": 0.0, "stop": ["a"]}, "run": {"too_long": "skip"}},
           "input": [{"path": "a", "size": 1}, {"path": "b", "size": 2}], "model": {"model": "m"},
           "config": {"whatever": 1}, "batchgen_version": "1"}
    new = {"output_config": {"sampling": {"temperature": 0.5, "stop": ["a"]}, "run": {"too_long": "skip",
                                                                                     "extra": 1}},
           "input": [{"path": "a", "size": 1}, {"path": "b", "size": 3}], "model": {"model": "m"},
           "config": {"whatever": 2}, "batchgen_version": "2"}
    assert diff(old, new) == ["output_config.run.extra: was None, now 1",
                              "output_config.sampling.temperature: was 0.0, now 0.5",
                              "input[1].size: was 2, now 3"]
    assert diff(old, old) == []


def test_diff_reports_a_list_of_another_length_whole():
    old = {"input": [{"path": "a"}]}
    new = {"input": [{"path": "a"}, {"path": "b"}]}
    assert diff(old, new) == [f"input: was {old['input']!r}, now {new['input']!r}"]


def test_keys_added_later_stay_out_of_the_hash_at_their_defaults():
    """An output written before beam search, the per-row columns, retry attempts and the OpenAI output existed
    resumes under the same hash: those keys enter the output config only when set (a real resume of the demo output
    was refused once for sampling.num_beams)."""
    from batchgen.output.manifest import output_config

    out = output_config(job())
    later = {"num_beams", "length_penalty", "early_stopping", "top_p_column", "n_column", "seed_column",
             "response_format_column", "attempt", "output"}
    keys = set(out["sampling"]) | set(out["dataset"]) | set(out["run"]) | set(out)
    assert not keys & later
    beams = output_config(set_key(job(), "sampling.num_beams", 4))
    assert beams["sampling"]["num_beams"] == 4


# -- secrets -----------------------------------------------------------------------------------------------------


def endpoint_job(extra_body: dict, *, catalog: dict | None = None) -> JobConfig:
    from batchgen.engines.endpoint.config import OpenAIConfig

    cfg = job()
    cfg.engine = OpenAIConfig(model="tiny", base_url="http://127.0.0.1:9/v1", extra_body=extra_body)
    cfg.output.sink, cfg.output.table, cfg.output.catalog = "iceberg", "nightly.rows", catalog or {}
    return cfg


def test_a_rotated_secret_keeps_the_hash_and_is_in_no_manifest():
    """engine.extra_body's and output.catalog's values under secret names are hashed and recorded masked: a rotated
    token resumes; a value that changes the generation still changes the hash."""
    old = endpoint_job({"api_token": "OLD-TOKEN-1", "top_k": 5}, catalog={"type": "rest", "token": "OLD-CAT-2"})
    new = endpoint_job({"api_token": "NEW-TOKEN-1", "top_k": 5}, catalog={"type": "rest", "token": "NEW-CAT-2"})
    assert config_hash(old) == config_hash(new)
    assert config_hash(endpoint_job({"api_token": "OLD-TOKEN-1", "top_k": 6})) != config_hash(old)
    resolved = {"output": {"storage_options": {"AWS_SECRET_ACCESS_KEY": "OLD-S3-3", "AWS_REGION": "eu-west-1"}}}
    text = json.dumps(build_manifest(old, resolved, FINGERPRINT))
    assert not [s for s in ("OLD-TOKEN-1", "OLD-CAT-2", "OLD-S3-3") if s in text] and "eu-west-1" in text
