"""Engine registry: `engine.name` -> a loader. Heavy imports happen only when an engine is built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from batchgen.engines.base import Engine, EngineConfig


def _load_hf(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.hf.engine import HFEngine

    return HFEngine(cfg, tokenizer)


def _load_vllm(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, tokenizer)


def _load_dummy(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.dummy import DummyEngine

    return DummyEngine(cfg, tokenizer)


ENGINES: dict[str, Callable[[EngineConfig, Any], Engine]] = {"hf": _load_hf, "vllm": _load_vllm,
                                                               "dummy": _load_dummy}


def build_engine(cfg: EngineConfig, tokenizer: Any) -> Engine:
    return ENGINES[cfg.name](cfg, tokenizer)


def quantization_problems(cfg: EngineConfig) -> list[str]:
    """Config problems of engine.quantization that need the engine's own knowledge (devices, dtypes, optional
    packages), before any load. Imports torch only when the hf engine is asked for a scheme."""
    if cfg.name != "hf" or cfg.quantization is None:
        return []
    from batchgen.engines.hf import quant

    return quant.check(cfg.quantization, cfg.device, cfg.dtype)


def structured_output_problems(cfg: EngineConfig, kind: Optional[str], choice_scores: bool,
                               reasoning: str = "off", max_reasoning_tokens: Optional[int] = None) -> list[str]:
    """Whether the engine can apply a sampling.<kind> constraint (and score choices, and think first), before any
    load: a vLLM without the structured-output API must refuse the job, never run it unconstrained."""
    out = []
    if cfg.name == "vllm" and reasoning != "off" and (kind is not None or max_reasoning_tokens is not None):
        out.append(f"sampling.reasoning={reasoning} with {'sampling.' + kind if kind else 'max_reasoning_tokens'}: "
                   f"engine=vllm would constrain (or cap) the reasoning too; use engine=hf, or split the reasoning "
                   f"without a constraint")
    if kind is not None and cfg.name == "dummy":
        out.append(f"sampling.{kind}: engine=dummy does not constrain its output; use engine=hf or engine=vllm")
    if kind is not None and cfg.name == "vllm":
        from batchgen.engines.vllm import structured_outputs_problem

        problem = structured_outputs_problem()
        if problem:
            out.append(f"sampling.{kind}: {problem}")
    if choice_scores and cfg.name != "hf":
        out.append(f"sampling.choice_scores=true is computed by engine=hf only (got engine={cfg.name})")
    return out


def prepare_process() -> None:
    """Process-wide settings the engines want before torch loads (OpenMP's waiting: hf/cpu/runtime.py). The CLI
    calls it first thing; it imports nothing heavy."""
    from batchgen.engines.hf.cpu.runtime import set_openmp_defaults

    set_openmp_defaults()
