"""Engine registry: `engine.name` -> what the engine is and can do (EngineSpec: its config class, its loader,
default part size, quantization schemes, features) and its config problems. Heavy imports happen only when an
engine is built (or, for the hf engine, when a quantization scheme is checked)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from batchgen.engines.base import Engine, EngineConfig
from batchgen.engines.dummy import DummyConfig
from batchgen.engines.endpoint.config import OpenAIConfig
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.vllm_config import VLLMConfig


def _load_hf(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.hf.engine import HFEngine

    return HFEngine(cfg, tokenizer)


def _load_vllm(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.vllm import VLLMEngine

    return VLLMEngine(cfg, tokenizer)


def _load_dummy(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.dummy import DummyEngine

    return DummyEngine(cfg, tokenizer)


def _load_openai(cfg: EngineConfig, tokenizer: Any) -> Engine:
    from batchgen.engines.endpoint.engine import OpenAIEngine

    return OpenAIEngine(cfg, tokenizer)


def _openai_sampling(cfg: Any, sampling: Any, dataset: Any) -> list[str]:
    from batchgen.constraints import KINDS
    from batchgen.engines.endpoint.wire import VLLM_DECODING, VLLM_PROCESSORS, unsupported
    from batchgen.sampling import DECODING, PROCESSOR_COLUMNS, PROCESSORS

    kind = next((k for k in KINDS if getattr(sampling, k, None) not in (None, "", [])), None)
    kind = kind or ("choice" if dataset.choice_column else None)
    extras = tuple(f"sampling.{k}" for k in VLLM_PROCESSORS if getattr(sampling, k) != PROCESSORS[k]) + tuple(
        f"dataset.{PROCESSOR_COLUMNS[k]}" for k in VLLM_PROCESSORS if getattr(dataset, PROCESSOR_COLUMNS[k])) + tuple(
        f"sampling.{k}" for k in VLLM_DECODING if getattr(sampling, k) != DECODING[k])
    out = unsupported(cfg.extensions, kind, sampling.top_k, sampling.ignore_eos, sampling.reasoning != "off", extras)
    if sampling.reasoning != "off" and cfg.extensions == "vllm" and cfg.tokenizer_dir() is None:
        out.append("sampling.reasoning: the reasoning is split from the generated token ids, which only a local "
                   "tokenizer decodes; set engine.tokenizer to the served model's, or leave sampling.reasoning=off")
    if cfg.endpoint == "chat" and (dataset.chat_template is not None or dataset.chat_template_kwargs):
        key = "dataset.chat_template" if dataset.chat_template is not None else "dataset.chat_template_kwargs"
        out.append(f"{key}: with engine.endpoint=chat the server renders the messages with its own template and "
                   "would not see it; remove it, or set engine.endpoint=completions (batchgen renders the prompt "
                   "with the local tokenizer, engine.tokenizer)")
    return out


def _vllm_for_task(cfg: Any, task: str, embed: Any) -> Any:
    """task=embed on vLLM: its pooling runner over the model's hidden states (engine.extra_args may override)."""
    if task != "embed":
        return cfg
    pooling = {"runner": "pooling", "convert": "embed",
               "pooler_config": {"pooling_type": embed.pooling.upper()}}
    return dataclasses.replace(cfg, extra_args=pooling | dict(cfg.extra_args))


def _hf_quantization(cfg: HFConfig) -> list[str]:
    from batchgen.engines.hf import quant

    return quant.check(cfg.quantization, cfg.device, cfg.dtype)


def _vllm_structured_outputs() -> Optional[str]:
    from batchgen.engines.vllm_config import structured_outputs_problem

    return structured_outputs_problem()


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is and can do, declared here beside its loader, so that the job asks and never names one."""

    config: type[EngineConfig]  # its settings: the shared engine.* keys and its own
    load: Callable[[Any, Any], Engine]  # (its config, the tokenizer) -> the engine
    rows_per_part: int  # its default commit unit (run.rows_per_part=null)
    quantization: tuple[str, ...]  # the engine.quantization schemes it takes (per device and dtype: its own check)
    beam_search: bool = True
    beam_early_stopping: bool = True  # sampling.early_stopping other than false
    constraints: bool = True  # sampling.<constraint>, per-row choice / schema columns
    choice_scores: bool = False
    reasoning_with_constraint: bool = True  # a constraint (or a reasoning cap) applied to the answer only
    constraints_available: Optional[Callable[[], Optional[str]]] = None  # why constraints cannot run here, if so
    check_quantization: Optional[Callable[[Any], list[str]]] = None  # a scheme on this device and dtype
    check_sampling: Optional[Callable[[Any, Any, Any], list[str]]] = None  # (engine, sampling, dataset) it refuses
    tasks: tuple[str, ...] = ("generate",)  # the job tasks it runs (task=loglik, embed, decide)
    for_task: Optional[Callable[[Any, str, Any], Any]] = None  # (engine config, task, embed config) -> its config
    draw: Optional[str] = None  # its seeded rows' draw, where batchgen makes it (recorded: seeded_draw)


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec(HFConfig, _load_hf, rows_per_part=256,
                     quantization=("int8", "int8_wo", "int4", "bnb-int8", "bnb-nf4"),
                     choice_scores=True, check_quantization=_hf_quantization, tasks=("generate", "loglik", "embed",
                                                                                   "decide"),
                     draw="counter-hash"),  # engines/hf/sampling/draw.py VERSION
    # vllm: one window per part keeps its scheduler busy
    "vllm": EngineSpec(VLLMConfig, _load_vllm, rows_per_part=1024,
                       quantization=("awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "gguf", "awq_marlin",
                                     "gptq_marlin", "experts_int8"),
                       beam_early_stopping=False, reasoning_with_constraint=False,
                       constraints_available=_vllm_structured_outputs, tasks=("generate", "embed"),
                       for_task=_vllm_for_task),
    # openai: an endpoint; its parts are journaled as answers arrive, so a part is a commit unit, not a batch
    "openai": EngineSpec(OpenAIConfig, _load_openai, rows_per_part=256, quantization=(), beam_search=False,
                         reasoning_with_constraint=False, check_sampling=_openai_sampling),
    "dummy": EngineSpec(DummyConfig, _load_dummy, rows_per_part=256, quantization=(), beam_search=False,
                        constraints=False),
}


def seeded_draw(name: str, samples: bool) -> dict[str, str]:
    """{"draw": engine `name`'s draw} where the job's rows may sample (EngineSpec.draw), else {}: in the output's
    config hash, so that a resume of an output whose rows were drawn otherwise (the hf engine's CPU draw before
    docs/output-and-resume.md's one change) is refused, while a greedy output's hash stays as it was."""
    draw = ENGINES[name].draw if name in ENGINES else None
    return {"draw": draw} if draw and samples else {}


def default_rows_per_part(name: str) -> int:
    """The engine's commit unit when run.rows_per_part is null (an unknown engine is refused by validate)."""
    return ENGINES[name].rows_per_part if name in ENGINES else 256


def task_engine(cfg: Any) -> EngineConfig:
    """The job's engine config as its task needs it (EngineSpec.for_task: task=embed on vLLM's pooling runner)."""
    spec = ENGINES.get(cfg.engine.name)
    if spec is None or spec.for_task is None:
        return cfg.engine
    return spec.for_task(cfg.engine, cfg.task, cfg.embed)


def build_engine(cfg: EngineConfig, tokenizer: Any) -> Engine:
    own, problems = engine_config(cfg)
    if problems:
        from batchgen.errors import ConfigError

        raise ConfigError(problems)
    return ENGINES[own.name].load(own, tokenizer)


def engine_config(cfg: EngineConfig) -> tuple[EngineConfig, list[str]]:
    """`cfg` as its engine's own config class, and a problem for each key it sets that this engine does not have.
    Hydra composes the engine's class already (conf/engine/NAME.yaml); a config made in Python may be the shared
    EngineConfig, or another engine's class with engine.name changed."""
    spec = ENGINES.get(cfg.name)
    if spec is None or type(cfg) is spec.config:
        return cfg, []
    mine = {f.name for f in dataclasses.fields(spec.config)}
    defaults = {f.name: getattr(type(cfg)(), f.name) for f in dataclasses.fields(cfg)}
    problems = [foreign_key(key, value, cfg.name) for key, value in vars(cfg).items()
                if key not in mine and (key not in defaults or value != defaults[key])]
    return spec.config(**{k: v for k, v in vars(cfg).items() if k in mine}), problems


def foreign_key(key: str, value: Any, engine: str) -> str:
    """engine.KEY set for an engine that has no such key: which engines have it."""
    owners = [name for name, spec in ENGINES.items() if key in {f.name for f in dataclasses.fields(spec.config)}]
    whose = f"a setting of engine={' / engine='.join(owners)}" if owners else "no engine's setting"
    return (f"engine.{key}={value!r} is {whose}; engine={engine} has no such key (remove it, or pass vLLM options "
            f"in engine.extra_args)")


def engine_problems(cfg: EngineConfig, sampling: Any, dataset: Any) -> list[str]:
    """Every problem of this engine with the job's engine.*, sampling.* and per-row dataset.* settings, before any
    load (the sampling settings themselves checked already)."""
    if cfg.name not in ENGINES:
        return [f"engine must be one of {', '.join(ENGINES)} (got {cfg.name!r})"]
    spec = ENGINES[cfg.name]
    out = _quantization_problems(cfg, spec)
    if sampling.num_beams > 1 and not spec.beam_search:
        out.append(f"sampling.num_beams > 1: engine={cfg.name} has no beam search; use engine=hf or engine=vllm")
    if sampling.num_beams > 1 and not spec.beam_early_stopping and sampling.early_stopping is not False:
        out.append(f"sampling.early_stopping: engine={cfg.name}'s beam search has none; leave it false")
    if spec.check_sampling is not None:
        out += spec.check_sampling(cfg, sampling, dataset)
    if (dataset.choice_column or dataset.schema_column) and not spec.constraints:
        out.append(f"dataset.choice_column / dataset.schema_column: engine={cfg.name} does not constrain its output")
    return out


def _quantization_problems(cfg: EngineConfig, spec: EngineSpec) -> list[str]:
    """engine.quantization: a scheme of this engine's, that its device and dtype can run (the engine's own check
    imports torch only when a scheme is asked for)."""
    if cfg.quantization is None:
        return []
    if cfg.quantization not in spec.quantization:
        choices = ", ".join(spec.quantization) if spec.quantization else "none yet (leave it null)"
        return [f"engine.quantization={cfg.quantization!r} is not supported by engine={cfg.name}; choices: {choices}"]
    return spec.check_quantization(cfg) if spec.check_quantization else []


def structured_output_problems(cfg: EngineConfig, kind: Optional[str], choice_scores: bool,
                               reasoning: str = "off", max_reasoning_tokens: Optional[int] = None) -> list[str]:
    """Whether the engine can apply a sampling.<kind> constraint (and score choices, and think first), before any
    load: an engine that cannot must refuse the job, never run it unconstrained."""
    spec, out = ENGINES[cfg.name], []
    if not spec.reasoning_with_constraint and reasoning != "off" and (kind is not None or max_reasoning_tokens
                                                                       is not None):
        out.append(f"sampling.reasoning={reasoning} with {'sampling.' + kind if kind else 'max_reasoning_tokens'}: "
                   f"engine={cfg.name} would constrain (or cap) the reasoning too; use engine=hf, or split the "
                   f"reasoning without a constraint")
    if kind is not None and not spec.constraints:
        out.append(f"sampling.{kind}: engine={cfg.name} does not constrain its output; use engine=hf or engine=vllm")
    if kind is not None and spec.constraints_available is not None:
        problem = spec.constraints_available()
        if problem:
            out.append(f"sampling.{kind}: {problem}")
    if choice_scores and not spec.choice_scores:
        out.append(f"sampling.choice_scores=true is computed by engine=hf only (got engine={cfg.name})")
    return out


def prepare_process() -> None:
    """Process-wide settings the engines want before torch loads (OpenMP's waiting: hf/cpu/runtime.py). The CLI
    calls it first thing; it imports nothing heavy."""
    from batchgen.engines.hf.backends.cpu.runtime import set_openmp_defaults

    set_openmp_defaults()
