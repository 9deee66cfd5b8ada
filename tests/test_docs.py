"""The documentation holds together: a short README with the two commands on its first screen, docs/ for the rest,
and every relative link in README.md and docs/*.md pointing at a file that exists (and, with an anchor, at one of
its headings, slugged as GitHub slugs them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation other than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()  # a link in a heading counts by its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one also as slug-1, slug-2, ..., as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(path: Path) -> list[tuple[str, str]]:
    """(text, target) of every relative link in a Markdown file."""
    return [(text, target) for text, target in LINK.findall(prose(path.read_text()))
            if not EXTERNAL.match(target)]


def test_slug_follows_github():
    assert slug("Python jobs and schedulers (`jobs/`)") == "python-jobs-and-schedulers-jobs"
    assert slug("GPU (CUDA)") == "gpu-cuda"
    assert slug("7. Bad input and exit codes") == "7-bad-input-and-exit-codes"
    assert slug("run_job and the `engine.max_batch_size` key") == "run_job-and-the-enginemax_batch_size-key"


def test_every_relative_link_points_at_an_existing_file_and_heading():
    checked, broken = 0, []
    for page in [README, *DOCS]:
        for text, target in links(page):
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: [{text}]({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
            checked += 1
    assert not broken, "\n".join(broken)
    assert checked >= len(DOCS)  # the check saw the links


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 220, len(lines)
    first_screen = "\n".join(lines[:40])
    assert "make demo" in first_screen and "make test" in first_screen


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(README)}
    assert DOCS and not [d.name for d in DOCS if d.resolve() not in linked]


def test_every_config_key_is_in_the_config_reference():
    """Every key of every config section and of every engine's own config class appears in the reference
    (conf/reference.md; the launcher's in the table docs/scaling-out.md holds, which the reference links)."""
    import dataclasses

    from batchgen.engines import ENGINES
    from batchgen.job import LauncherConfig, OutputConfig, RunConfig
    from batchgen.reader import DatasetConfig
    from batchgen.sampling import SamplingConfig

    reference = (ROOT / "conf" / "reference.md").read_text()
    scaling = (ROOT / "docs" / "scaling-out.md").read_text()
    sections = [("dataset", DatasetConfig, reference), ("sampling", SamplingConfig, reference),
                ("run", RunConfig, reference), ("output", OutputConfig, reference),
                ("launcher", LauncherConfig, scaling)] + [("engine", spec.config, reference)
                                                          for spec in ENGINES.values()]
    missing = {f"{section}.{f.name}" for section, cls, doc in sections for f in dataclasses.fields(cls)
               if f.name != "name" and f"`{section}.{f.name}`" not in doc}
    assert not missing, f"config keys not in the reference: {sorted(missing)}"


def test_the_docs_reference_is_the_one_batchgen_help_shows():
    """docs/configuration.md's "Config reference" is generated from conf/reference.md, which `batchgen help`
    reads: regenerate it (python -m batchgen.commands.keys --write-docs docs/configuration.md) after editing."""
    from batchgen.commands.keys import docs_block

    assert docs_block() in (ROOT / "docs" / "configuration.md").read_text()


def test_the_module_map_is_generated_from_the_modules_docstrings_and_complete():
    """docs/development.md's module map is what scripts/module_map.py prints now: every module of batchgen/ in it,
    each with its docstring's first sentence (regenerate with `python scripts/module_map.py --write`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
    module_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_map)
    documented = module_map.documented()
    modules = [p for p in (ROOT / "batchgen").rglob("*.py") if "__pycache__" not in p.parts]
    missing = [p.relative_to(ROOT).as_posix() for p in modules
               if p.name != "__init__.py" and f"- `{p.name}`:" not in documented]
    assert not missing, f"not in the module map: {missing}; run python scripts/module_map.py --write"
    assert "(no docstring)" not in documented
    assert documented == module_map.module_map(), "the module map is stale: run python scripts/module_map.py --write"
