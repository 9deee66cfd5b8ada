"""Config keys by name, before Hydra sees them: every key a job config has (config_keys), and an override naming no
key answered with the key it likely means (a typo, a key without its section, an engine's key under another
engine). Knows the config dataclasses, not Hydra (compose.py, the one module that composes, calls these)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from batchgen.commands.keys import VLLM_NAMES, vllm_answer
from batchgen.engines import ENGINES, foreign_key
from batchgen.job import JobConfig, LauncherConfig, OutputConfig, RunConfig
from batchgen.reader import DatasetConfig
from batchgen.sampling import SamplingConfig

GROUPS = ("job", "engine", "dataset", "sampling", "launcher")  # config groups: `engine=vllm` picks a file, not a key


def unknown_keys(overrides: list[str], engine: Optional[str] = None) -> list[str]:
    """Every override naming a key JobConfig does not have (Hydra stops at the first), with a likely spelling; an
    engine.* key is checked against `engine`'s config class (against every engine's when it is not known)."""
    problems = []
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" not in arg or key.startswith("hydra") or key in GROUPS:
            continue
        if key.startswith("engine."):
            problems += _engine_key_problems(key, arg.split("=", 1)[1], engine)
            continue
        node: object = JobConfig
        for i, name in enumerate(key.split(".")):
            if not dataclasses.is_dataclass(node):
                break  # a dict-valued key: any sub-key goes
            fields = {f.name: f for f in dataclasses.fields(node)}
            if name not in fields:
                problems.append(_no_such_key(key, ".".join(key.split(".")[:i]), list(fields)))
                break
            typ = fields[name].type
            node = SECTIONS.get(typ if isinstance(typ, str) else getattr(typ, "__name__", ""))
    return problems


# JobConfig's sections by type name (its annotations are strings), for walking a dotted key
SECTIONS = {"DatasetConfig": DatasetConfig, "SamplingConfig": SamplingConfig, "RunConfig": RunConfig,
            "LauncherConfig": LauncherConfig, "OutputConfig": OutputConfig}


def _no_such_key(key: str, prefix: str, names: list[str]) -> str:
    """An unknown key, its likely meaning and where to read about it: `batchgen help`, which every install has (a
    wheel has no docs/ folder). A vLLM name (VLLM_NAMES: max_tokens) is answered with its batchgen key, or why there
    is none, never with a look-alike."""
    name = key.rsplit(".", 1)[-1]
    target = VLLM_NAMES.get(name, ("", ""))[0]
    if name in VLLM_NAMES and target.rsplit(".", 1)[-1] != name:  # a name batchgen spells otherwise, or lacks
        hint = f" (did you mean {target}, vLLM's {name}?)" if target else f" ({vllm_answer(name)})"
        return f"{key}: no such config key{hint}; see batchgen help {name}"
    likely = _likely_keys(key, prefix, names)
    hint = f" (did you mean {' or '.join(likely)}?)" if likely else ""
    about = (likely[0] if len(likely) == 1 else key.rsplit(".", 1)[-1] if likely else prefix.split(".")[0]
             or "SECTION (dataset, engine, sampling, run, output, launcher)")
    return f"{key}: no such config key{hint}; see batchgen help {about}"


def _likely_keys(key: str, prefix: str, names: list[str]) -> list[str]:
    """What an unknown key was likely meant to be: its misspelt part corrected at its own level (datset.path:
    dataset.path), or, where the last part is closer to a key's name in another section, the keys of that name
    (temperature, run.temprature: sampling.temperature), as `batchgen help temperature` finds them."""
    from difflib import SequenceMatcher

    def ratio(a: str, b: str) -> float:
        return SequenceMatcher(None, a, b).ratio()

    parts = key.split(".")
    depth = len(prefix.split(".")) if prefix else 0
    segment, rest = parts[depth], parts[depth + 1:]
    here = max(names, key=lambda name: ratio(segment, name), default="")
    every = config_keys()
    there = max({k.rsplit(".", 1)[-1] for k in every}, key=lambda tail: ratio(parts[-1], tail))
    mine = ratio(segment, here)
    if mine >= 0.6 and (rest or mine >= ratio(parts[-1], there)):
        return [".".join([*([prefix] if prefix else []), here, *rest])]
    return [k for k in every if k.rsplit(".", 1)[-1] == there] if ratio(parts[-1], there) >= 0.6 else []


def config_keys() -> list[str]:
    """Every key of JobConfig's sections and of every engine's config class, dotted (sampling.temperature); a field
    that is not a section (name, task) as it is."""
    out = []
    for f in dataclasses.fields(JobConfig):
        section = SECTIONS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if f.name == "engine":
            out += sorted({f"engine.{g.name}" for spec in ENGINES.values() for g in dataclasses.fields(spec.config)})
        else:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(section)] if section else [f.name]
    return out


def _engine_key_problems(key: str, value: str, engine: Optional[str]) -> list[str]:
    """engine.KEY: a key of the chosen engine's config class (any engine's when the choice is not known yet); a
    dict-valued key (engine.extra_args.*) takes any sub-key."""
    name = key.split(".")[1]
    every = {f.name for spec in ENGINES.values() for f in dataclasses.fields(spec.config)}
    if name not in every:
        return [_no_such_key(key, "engine", sorted(every))]
    if engine in ENGINES and name not in {f.name for f in dataclasses.fields(ENGINES[engine].config)}:
        return [foreign_key(name, value, engine)]
    return []
