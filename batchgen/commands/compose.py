"""The job's config from Hydra: the one module that composes it (cli.py runs the job under hydra.main). It holds
where the config lives (conf/, shipped in the package, and the user's own directories named by --config-dir
or BATCHGEN_CONF_DIR), registers the dataclasses as Hydra's schemas, checks overrides and the presets they pick before
Hydra sees them (unknown keys with their likely spelling and `batchgen help KEY`, another engine's keys, misspelt
group options, values its grammar cannot read) and converts the composed config to JobConfig once (to_job_config).
`batchgen retry` rebuilds a config from a run's manifest here too (config_from).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchgen.checks import validate
from batchgen.commands.keynames import GROUPS, unknown_keys
from batchgen.confdir import conf_dir
from batchgen.engines import ENGINES
from batchgen.errors import ConfigError
from batchgen.job import JobConfig
from batchgen.prompts.texts import unescape_texts

CONF_DIR = str(conf_dir())  # the root config, the groups, the presets
USER_CONF_ENV = "BATCHGEN_CONF_DIR"  # directories of the user's own presets (DIR/job/NAME.yaml), os.pathsep-separated
_config_dirs: list[str] = []  # from --config-dir DIR on the command line (main() takes them out of argv)


def _open_dicts(node: Any) -> DictConfig:
    """A config class as Hydra's schema, its dict-valued keys (engine.extra_body, output.catalog) open: set whole on
    the command line (`output.catalog='{type: sql, ...}'`), a key Hydra's struct mode would refuse to add."""
    cfg = OmegaConf.structured(node)
    _open(cfg)
    return cfg


def _open(cfg: DictConfig) -> None:
    for key in cfg:
        value = None if OmegaConf.is_missing(cfg, key) or OmegaConf.is_interpolation(cfg, key) else cfg[key]
        if isinstance(value, DictConfig):
            if OmegaConf.get_type(value) is dict:
                OmegaConf.set_struct(value, False)
            else:
                _open(value)


ConfigStore.instance().store(name="batchgen_schema", node=_open_dicts(JobConfig))
for _name, _spec in ENGINES.items():  # each engine's config class, under its group file (conf/engine/NAME.yaml)
    ConfigStore.instance().store(group="engine", name=f"{_name}_schema", node=_open_dicts(_spec.config))


def to_job_config(cfg: DictConfig, check: bool = True) -> JobConfig:
    """The one conversion from Hydra's config to dataclasses; validated unless `check` is false (load_job: run_job
    validates once the caller has set what the preset leaves open)."""
    try:
        job = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise ConfigError([f"{key}: {getattr(exc, 'msg', exc)}"]) from exc
    assert isinstance(job, JobConfig)
    return validate(job) if check else job


def load_job(preset: Optional[str] = None, overrides: Optional[list[str]] = None,
             config_dir: Optional[str] = None) -> JobConfig:
    """batchgen.load_job: a preset (job=NAME, from batchgen's presets or `config_dir`'s) with key=value overrides,
    as the command line composes it, checked for unknown keys and bad values; the paths it names are checked when
    the job runs (run_job or generate), so that the caller can set them first. `config_dir` is searched by this call
    only: a later call without it does not see its presets."""
    added = config_dir is not None and config_dir not in _config_dirs
    if added:
        _config_dirs.append(str(config_dir))
    try:
        cfg = composed(([f"job={preset}"] if preset else []) + list(overrides or []))
    finally:
        if added:
            _config_dirs.remove(str(config_dir))
    if OmegaConf.is_missing(cfg, "name"):
        cfg.name = preset or "job"
    # dataset.path and engine.model may be left open for the caller to set (generate sets dataset.path); run_job's
    # check names the one that stays empty
    for section, key in (("dataset", "path"), ("engine", "model")):
        if OmegaConf.is_missing(cfg[section], key):
            cfg[section][key] = ""
    return to_job_config(cfg, check=False)


def shown_yaml(cfg: DictConfig, resolve: bool = False) -> str:
    """A composed config as `--cfg job` prints it: its text keys as the job uses them (texts.py's newlines made), a
    text holding a newline, a tab or a backslash in YAML's double quotes, whose escapes say which it is ("\\n" a
    newline, "\\\\n" a backslash and an n); the rest as Hydra prints it."""
    import yaml

    unescape_texts(cfg)
    data = OmegaConf.to_container(cfg, resolve=resolve)

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = '"' if any(c in value for c in "\n\t\\") else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def user_conf_dirs() -> list[Path]:
    """The user's config directories, searched after batchgen's own: --config-dir's, then BATCHGEN_CONF_DIR's."""
    env = [d for d in os.environ.get(USER_CONF_ENV, "").split(os.pathsep) if d]
    return [Path(d).expanduser().resolve() for d in [*_config_dirs, *env]]


def conf_dirs() -> list[Path]:
    return [Path(CONF_DIR), *user_conf_dirs()]


def conf_dir_problems() -> list[str]:
    return [f"{d}: no such config directory (--config-dir or {USER_CONF_ENV}); it holds your presets as "
            f"job/NAME.yaml (and any group option as GROUP/NAME.yaml)" for d in user_conf_dirs() if not d.is_dir()]


def with_search_path(overrides: list[str]) -> list[str]:
    """`overrides` plus Hydra's search path override naming the user's config directories, if any."""
    dirs = user_conf_dirs()
    if not dirs or any(arg.startswith("hydra.searchpath=") for arg in overrides):
        return overrides
    quoted = ",".join("'file://" + str(d).replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs)
    return [*overrides, f"hydra.searchpath=[{quoted}]"]


def take_config_dirs(argv: list[str]) -> list[str]:
    """argv without `--config-dir DIR` / `--config-dir=DIR` / `-cd DIR`, whose directories it remembers (for the
    job and every command alike)."""
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            _config_dirs.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config-dir="):
            _config_dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return rest


def group_file(group: str, choice: str) -> Optional[Path]:
    """conf/GROUP/CHOICE.yaml in batchgen's config or a user's; None where no directory has it."""
    return next((d / group / f"{choice}.yaml" for d in conf_dirs() if (d / group / f"{choice}.yaml").is_file()),
                None)


def _chosen_engine(overrides: list[str]) -> Optional[str]:
    """engine.name as the config groups picked in `overrides` (engine=..., job=...) make it; None when they do not
    compose (the full composition then says why). Call inside Hydra's initialize_config_dir."""
    from hydra import compose

    groups = [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") in GROUPS]
    groups += [arg for arg in overrides if arg.split("=", 1)[0].lstrip("+~") == "engine.name"]
    try:
        return compose(config_name="config", overrides=with_search_path(groups)).engine.name
    except Exception:  # noqa: BLE001 - reported by the full composition
        return None


def compose_checked(overrides: list[str]) -> JobConfig:
    """The job config from `overrides`, composed without starting a Hydra run (nothing written), and validated;
    ConfigError with every problem (unknown keys with their likely spelling, composition errors, bad values)."""
    cfg = composed(overrides)
    if OmegaConf.is_missing(cfg, "name"):
        raise ConfigError(["name is required: pick a job (job=demo) or set name=..."])
    return to_job_config(cfg)


def composed(overrides: list[str]) -> DictConfig:
    """Hydra's config from `overrides`, after the checks Hydra would stop at (or word badly): the user's config
    directories, values its grammar cannot read, unknown group options and keys; ConfigError naming each."""
    from hydra import compose, initialize_config_dir

    problems = conf_dir_problems() or unreadable(overrides) + unknown_options(overrides)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        if not problems:
            engine = _chosen_engine(overrides)
            problems = unknown_keys(overrides, engine) + preset_problems(overrides, engine)
        if problems:
            raise ConfigError(problems)
        try:
            return compose(config_name="config", overrides=with_search_path(overrides))
        except Exception as exc:  # Hydra's composition errors: a bad value for a key's type, say
            raise ConfigError([hydra_reason(exc)]) from exc


def preset_problems(overrides: list[str], engine: Optional[str]) -> list[str]:
    """The unknown keys of the preset and group files `overrides` pick (job=NAME, dataset=NAME, and what their
    defaults lists pick), each named with its file and its full key, as a command line's are: Hydra stops at the
    first, naming neither the file nor the likely key."""
    todo = [(group.lstrip("+~"), choice) for group, _, choice in (arg.partition("=") for arg in overrides)]
    problems, seen = [], set()
    while todo:
        group, choice = todo.pop(0)
        path = group_file(group, choice) if group in GROUPS and choice not in ("", "null") else None
        if path is None or path in seen:
            continue  # no such option: unknown_options names it
        seen.add(path)
        keys, picks = preset_keys(path, group)
        todo += picks
        if group == "job" and keys and all(k.startswith("job.") for k in keys):
            problems.append(f"{path}: a job preset sets the config's own keys (name, dataset.path, ...): make its "
                            f"first line `# @package _global_`")
            continue
        problems += [f"{path}: {problem}" for problem in unknown_keys(keys, engine)]
    return problems


def preset_keys(path: Path, group: str) -> tuple[list[str], list[tuple[str, str]]]:
    """A group file's keys as `key=value` overrides, under the package Hydra merges it at (its `# @package` header:
    _global_ the root; none, its group), and the (group, option) pairs its defaults list picks. A file that is not
    YAML gives neither: Hydra says what is wrong with it."""
    import yaml

    text = path.read_text(encoding="utf-8")
    head = [line for line in text.splitlines()[:5] if line.startswith("#") and "@package" in line]
    package = head[0].split("@package", 1)[1].strip() if head else "_group_"
    prefix = package.replace("_group_", group).replace("_global_", "").strip(".")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return [], []
    if not isinstance(data, dict):
        return [], []
    defaults = data.pop("defaults", None)
    picks = [(key.replace("override", "").strip().lstrip("/"), choice) for item in defaults or []
             if isinstance(item, dict) for key, choice in item.items() if isinstance(choice, str)]
    return _dotted(data, prefix), picks


def _dotted(node: dict, prefix: str) -> list[str]:
    out = []
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out += _dotted(value, name) if isinstance(value, dict) and value else [f"{name}={value}"]
    return out


def unreadable(overrides: list[str]) -> list[str]:
    """Overrides Hydra's grammar cannot read (braces, `\\n`, non-ASCII characters... in an unquoted value): one
    problem each, naming the key and the quoting that works."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, problems = OverridesParser.create(), []
    for arg in overrides:
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            key, _, value = arg.partition("=")
            quoted = value.replace('"', '\\"')
            problems.append(f"{key}: Hydra's override grammar cannot read this value unquoted (braces, quotes, "
                            f"backslashes or non-ASCII characters need quoting). Quote it for Hydra inside the "
                            f"shell's quotes: '{key}=\"{quoted[:60]}{'...' if len(quoted) > 60 else ''}\"', or set "
                            f"it in a preset (a YAML file, DIR/job/NAME.yaml with --config-dir DIR), where any text "
                            f"goes")
    return problems


def unknown_options(overrides: list[str]) -> list[str]:
    """GROUP=CHOICE naming no file of conf/GROUP/: the choices, and the likely one."""
    import difflib

    problems = []
    for arg in overrides:
        group, _, choice = arg.partition("=")
        group = group.lstrip("+~")
        if group not in GROUPS or choice in ("", "null") or group_file(group, choice):
            continue
        options = group_options(group)
        close = difflib.get_close_matches(choice, options, n=1)
        hint = f" (did you mean {group}={close[0]}?)" if close else ""
        problems.append(f"{group}={choice}: no such option{hint}; choices: {', '.join(options)}")
    return problems


def group_options(group: str) -> list[str]:
    """The choices of config group `group`: its files in batchgen's config and the user's."""
    return sorted({p.stem for d in conf_dirs() for p in (d / group).glob("*.yaml")})


def hydra_reason(exc: Exception) -> str:
    """Hydra's composition error as one line with its reason (its first line alone drops it: "Error merging
    override sampling.temperature=hot"); OmegaConf's key and type bookkeeping left out."""
    text = "\n".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith(("full_key:", "reference_type=", "object_type=",
                                                           "To append to your config"))]
    return ": ".join(keep[:2]) if keep else type(exc).__name__


def config_from(resolved: dict, overrides: list[str]) -> JobConfig:
    """A job config from an earlier run's resolved config (its manifest's `config`) with `overrides` on top, validated
    (batchgen retry); ConfigError naming every problem."""
    engine = resolved.get("engine") if isinstance(resolved.get("engine"), dict) else {}
    spec = ENGINES.get(engine.get("name", "hf"))
    problems = group_switches(overrides, resolved) + unknown_keys(overrides, engine.get("name", "hf"))
    if problems:
        raise ConfigError(problems)
    if spec is not None:  # its engine's class; an output written before engines had their own keeps only those
        mine = {f.name for f in dataclasses.fields(spec.config)}
        resolved = resolved | {"engine": {k: v for k, v in engine.items() if k in mine}}
    schema = OmegaConf.structured(JobConfig)
    try:
        if spec is not None:
            schema = OmegaConf.merge(schema, {"engine": OmegaConf.structured(spec.config)})
        cfg = OmegaConf.merge(schema, resolved, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError([f"{getattr(exc, 'full_key', None) or 'config'}: {getattr(exc, 'msg', exc)}"]) from exc
    return to_job_config(cfg)  # type: ignore[arg-type]


def group_switches(overrides: list[str], resolved: dict) -> list[str]:
    """A config group picked on top of an earlier run's resolved config (`sampling=sample` on a retry): Hydra picks
    a group's file when it composes, and that config is composed already. One problem each, naming what to set
    instead."""
    problems = []
    for arg in overrides:
        key, _, choice = arg.partition("=")
        group = key.lstrip("+~")
        if group in GROUPS:
            problems.append(f"{arg}: a retry cannot switch the config group {group} (it starts from the job's "
                            f"resolved config); {_instead(group, choice, resolved.get(group))}")
    return problems


def _instead(group: str, choice: str, current: object) -> str:
    """What to set instead of `group=choice`: the keys of conf/GROUP/CHOICE.yaml whose values differ from the
    job's (`current`)."""
    path = group_file(group, choice)
    if group == "job":  # a preset of the whole config
        return "set the keys you want changed one by one, e.g. sampling.temperature=0.7"
    picked = OmegaConf.to_container(OmegaConf.load(path)) if path is not None else None
    if not isinstance(picked, dict) or not isinstance(current, dict):
        return f"set the keys under {group} one by one, e.g. {group}.KEY=VALUE"
    picked.pop("defaults", None)  # the group file's schema, not a key
    changes = " ".join(f"{group}.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in picked.items()
                       if not isinstance(v, dict) and current.get(k) != v)  # json: as Hydra's grammar reads it
    if not changes:
        return f"the job's config has what {group}/{choice}.yaml sets already: leave it out"
    return f"set the keys it would change instead: {changes}"


