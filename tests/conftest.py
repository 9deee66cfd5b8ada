"""Shared fixtures: a tiny random Llama built once per session, datasets written per test, and the
real Hydra config composed the way the CLI composes it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from batchgen.commands.compose import CONF_DIR, to_job_config
from batchgen.job import JobConfig

WORDS = ("the river town market opened closed with many people after rain sun night lamp bread "
         "clock train harbour music quiet loud green blue small large old new fast slow").split()
REPO = Path(__file__).resolve().parent.parent
# batchgen's native CPU kernels compile into this test run's own cache (and subprocesses inherit it), not the home
# one; pytest-xdist's workers share their run's (a library is written under a temporary name, then renamed)
_XDIST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("BATCHGEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"batchgen-kernels-{_XDIST_RUN}")
                      if _XDIST_RUN else tempfile.mkdtemp(prefix="batchgen-kernels-"))


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from batchgen.engines.toymodel import build_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    build_model(path, corpus(), size="tiny")
    return str(path)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> str:
    """Hidden size 256: every linear has whole int4 groups of 128 (the tiny model's 64 has none), and W8A8's int8
    linears are the engine's quantized modules."""
    from batchgen.engines.toymodel import build_model

    path = tmp_path_factory.mktemp("models") / "small-llama"
    build_model(path, corpus(), size="small")
    return str(path)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def compose_job(overrides: list[str]) -> JobConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return to_job_config(cfg)


def job_overrides(tiny_model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return ["name=t", f"output_dir={out}", f"dataset.path={data}", "dataset.format=auto",
            f"engine.model={tiny_model}", "engine.dtype=float32", "run.progress=false", *extra]


def keyed_rows(n: int, prefix: str, seed: int) -> list[dict]:
    """`n` rows of {uid: <prefix><index>, prompt: a corpus line}: an input with an id column."""
    return [{"uid": f"{prefix}{i:03d}", "prompt": p} for i, p in enumerate(corpus(n, seed=seed))]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict | str | bytes]) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
            f.write(line + b"\n")
    return path


def read_output(out: Path) -> pa.Table:
    import pyarrow.dataset as ds

    return ds.dataset(str(out), format="parquet").to_table()


def run_cli(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | kwargs.pop("env", {})
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", REPO), env=env, **kwargs)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A local S3 endpoint on 127.0.0.1 and the environment that points fsspec/s3fs at it (this process and the
    jobs it starts)."""
    moto_server = pytest.importorskip("moto.server", reason="the S3 tests need moto[server]")
    pytest.importorskip("s3fs", reason="the S3 tests need s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
           "BATCHGEN_STAGING_DIR": str(tmp_path_factory.mktemp("staging"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = env["FSSPEC_S3_ENDPOINT_URL"]  # read at import
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    if not fs.exists("bucket"):  # moto's store is shared by every server of this process
        fs.mkdir("bucket")
    yield fs, env
    fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def dummy_overrides(tokenizer_dir: str, data: Path, out: Path, *extra: str) -> list[str]:
    """job_overrides on engine=dummy (batchgen/engines/dummy.py): no model, each generation a deterministic function
    of its request, so a test of the pipeline (reading, parts, resume, retry, output files) runs without loading
    weights; `tokenizer_dir` gives the tokenizer (the tiny model's directory serves)."""
    return ["name=t", f"output_dir={out}", f"dataset.path={data}", "dataset.format=auto", "engine=dummy",
            f"engine.model={tokenizer_dir}", "run.progress=false", *extra]


def run_benchmark(script: str, workdir: Path, *args: str) -> tuple[dict, str]:
    """`python benchmarks/SCRIPT *args --workdir WORKDIR --json ...` from the repository root: its JSON report and
    its printed table (the run failing fails the test, with its stderr)."""
    out = workdir / f"{Path(script).stem}.json"
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--workdir", str(workdir), "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def generate_generic(engine, requests: list) -> list:
    """The hf engine's results for `requests` on its generic path (the model's own forward, any architecture),
    instead of the continuous-batching fast path; the engine is left on the fast path."""
    engine.fast = False
    try:
        return engine.generate(requests)
    finally:
        engine.fast = True
