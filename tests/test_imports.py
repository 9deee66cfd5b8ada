"""The package's shape: rooms by data flow with no import climbing a floor, no import circle among batchgen's
modules (imports inside functions included), and the job side (runner, planner, committer, reader) never imports an
engine's internals."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchgen"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:  # relative
                    base = ".".join(name.split(".")[:-node.level] + [node.module])
                for alias in node.names:  # `from pkg import submodule` imports the submodule, not pkg's names
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_job_side_knows_engines_only_through_the_registry():
    graph = imports()
    job_side = [m for m in graph if m in ("batchgen.run.runner", "batchgen.prompts.planner",
                                          "batchgen.output.committer", "batchgen.job")
                or m == "batchgen.reader" or m.startswith("batchgen.reader.")]
    assert len(job_side) > 5
    for name in job_side:
        internals = {m for m in graph[name] if m.startswith("batchgen.engines.") and m != "batchgen.engines.base"}
        assert not internals, (name, internals)
    hf = {m for m in graph if m.startswith("batchgen.engines.hf")}
    outside = {m: graph[m] & hf for m in graph if m not in hf and graph[m] & hf}
    assert set(outside) == {"batchgen.engines"}, outside  # the registry's loader, and nothing else


def test_the_engines_folder_and_module_sizes():
    """engines/ holds the registry, base, the hf package, vllm (its engine and its config), the endpoint package,
    dummy and the stand-in model; no module is over 380 lines."""
    engines = PACKAGE / "engines"
    assert sorted(p.name for p in engines.iterdir() if p.name != "__pycache__") == [
        "__init__.py", "base.py", "dummy.py", "endpoint", "hf", "toymodel.py", "vllm.py", "vllm_config.py"]
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {name: lines for name, lines in sizes.items() if lines > 380}
    assert not long, long


def test_functions_read_as_steps():
    """No function in batchgen/ over 40 lines (a long sequence that must stay together is split into named steps,
    or numbered in comments within the limit)."""
    import ast

    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 40:
                long[f"{path.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def test_hydra_is_known_in_one_place():
    """commands/compose.py composes the config (and cli.py runs the job under hydra.main); nothing else imports
    hydra or omegaconf: the rest of the package sees plain dataclasses."""
    import ast

    knowing = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("hydra", "omegaconf") for n in names):
                knowing.add(str(path.relative_to(PACKAGE)))
    assert knowing == {"commands/compose.py", "commands/cli.py"}, knowing


# The rooms in data-flow order: a module imports from its own room or from rooms further down, never up. The shared
# vocabulary (records, sampling, constraints, errors, fsutil, version) is the ground floor; the job's root config
# (job.py) composes the rooms' configs and checks.py checks them across rooms, and the package's __init__ / __main__
# are its front doors: those four may look up.
FLOORS = {"vocabulary": 0, "reader": 1, "engines": 1, "prompts": 2, "output": 2, "run": 3, "commands": 4}
FRONT_DOORS = {"batchgen", "batchgen.__main__", "batchgen.job", "batchgen.checks"}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "vocabulary"


def test_rooms_by_data_flow_and_no_import_climbs():
    graph = imports()
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    for folder in [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"]:
        assert len(list(folder.glob("*.py"))) <= 16, folder
    climbs = sorted(f"{a} -> {b}" for a, deps in graph.items() if a not in FRONT_DOORS for b in deps
                    if FLOORS[room(b)] > FLOORS[room(a)])
    assert not climbs, climbs


def test_tests_mirror_the_package():
    """tests/<folder>/ for each of the package's folders that has tests, plus tests/scenarios/ (end-to-end stories)
    and tests/vllm_tier/ (the vLLM tier, its own venv); no other folder."""
    tests = PACKAGE.parent / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    package = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {"scenarios", "vllm_tier"} <= package, folders - package


def test_the_job_config_names_no_engine():
    """Each engine declares its defaults, quantization schemes, own keys and features (engines.EngineSpec); job.py
    asks the registry and never compares engine names."""
    tree = ast.parse((PACKAGE / "job.py").read_text())
    names = {"hf", "vllm", "dummy"}
    found = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names]
    assert not found, found


def test_the_command_line_loads_neither_torch_nor_transformers_before_it_needs_a_model():
    """The CPU runtime's settings (engines/hf/backends/cpu/runtime.py) are made when the command line is imported,
    which must happen before torch loads (OpenMP reads them once); and a command that needs no model (--help, a
    config error, status) answers in well under a second instead of paying torch's and transformers' imports."""
    import subprocess
    import sys

    probe = ("import sys, batchgen.commands.cli; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_no_global_rebinding():
    """Module state lives in one named object (cli.Invocation) or a cached function, never behind `global`."""
    import ast

    rebinding = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert not rebinding, rebinding


def test_the_config_is_edited_at_the_top_and_imported_from_there():
    """conf/ sits at the top of the checkout, as the design card lays the project out; the package reads it as
    batchgen.conf (setup.py maps it), so an edit in conf/ is what the editable install composes."""
    import batchgen.conf

    from batchgen.commands.compose import CONF_DIR

    assert not (PACKAGE / "conf").exists() and (PACKAGE.parent / "conf" / "config.yaml").exists()
    assert Path(batchgen.conf.__file__).resolve().parent == PACKAGE.parent / "conf" == Path(CONF_DIR)


def test_a_source_tree_on_pythonpath_finds_the_top_level_conf(monkeypatch):
    """Without an install (the GPU check runs the checkout through PYTHONPATH) batchgen.conf is not importable: the
    checkout's conf/ is the config."""
    import sys

    from batchgen.confdir import conf_dir

    monkeypatch.setitem(sys.modules, "batchgen.conf", None)  # import batchgen.conf now raises ModuleNotFoundError
    assert conf_dir() == PACKAGE.parent / "conf"


def test_the_summary_is_filled_in_one_place():
    """A run's Summary is filled by the run's steps (run/lifecycle.py) and its own methods (run/progress.py); every
    other module hands them typed records (lifecycle.Driven, PartStats, ray_job.PartDone)."""
    import re

    assigned = re.compile(r"\bsummary\.\w+(\.\w+)* *(\+|-)?= ")
    allowed = {PACKAGE / "run" / "lifecycle.py", PACKAGE / "run" / "progress.py"}
    found = [f"{path.relative_to(PACKAGE.parent)}:{i}" for path in sorted(PACKAGE.rglob("*.py")) if path not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1) if assigned.search(line)]
    assert not found, f"Summary fields set outside run/lifecycle.py: {found}"


def test_the_config_is_handed_down_not_passed_around():
    """scripts/config_walk.py on its 40-row job: the config goes down into another folder and comes back up (a
    climb) at most 6 times (11 before the set-up handed modules their typed values: Share, the config hash)."""
    import re
    import subprocess
    import sys

    script = PACKAGE.parent / "scripts" / "config_walk.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r"visits (\d+), modules \d+, folders \d+, moves (\d+), climbs (\d+)", out.stdout)
    assert found, out.stdout[-2000:]
    visits, moves, climbs = map(int, found.groups())
    assert visits > 20 and climbs <= 6 and moves <= 8, out.stdout
