"""batchgen's native CPU kernels: built once into the cache, and never a reason for a job to fail."""

from __future__ import annotations

import logging

import pytest

from batchgen.engines import cpu_kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache and no loaded library; the session's library is back afterwards."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    cpu_kernels.reset()
    yield tmp_path
    cpu_kernels.reset()


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("BATCHGEN_NATIVE_KERNELS", "0")
    assert cpu_kernels.load() is None and not list(fresh.iterdir())


def test_no_compiler_means_torch_kernels(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert cpu_kernels.load() is None


def test_a_failing_compile_is_logged_not_raised(fresh, monkeypatch, caplog):
    if not cpu_kernels.wanted():
        pytest.skip("this CPU does not take batchgen's AVX2 kernels")
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "building batchgen's CPU kernels failed" in caplog.text
    assert not list(fresh.iterdir())  # no half-written library left behind


def test_built_once_then_loaded_from_the_cache(fresh):
    if not cpu_kernels.wanted():
        pytest.skip("this CPU does not take batchgen's AVX2 kernels")
    if cpu_kernels.load() is None:
        pytest.skip("no working C compiler here")
    built = list(fresh.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    cpu_kernels.reset()
    assert cpu_kernels.load() is not None and built[0].stat().st_mtime_ns == stamp
