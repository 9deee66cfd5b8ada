"""A launcher=ray worker (PartWorker, run here in this process as a Ray actor runs it) renders from the driver's
record (PromptPin): a worker started mid-run after the chat template file was edited renders the driver's text, and
one that finds other model prompt files than the driver read refuses to run. The cluster runs: tests/run/test_ray.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.errors import ResumeMismatchError
from batchgen.run.prepare import open_input, open_output
from batchgen.run.ray_job import PartWorker, PromptPin
from tests.conftest import compose_job, dummy_overrides, write_parquet

OLD = "{% for m in messages %}OLD {{ m['content'] }}\n{% endfor %}"
NEW = "{% for m in messages %}NEW {{ m['content'] }}\n{% endfor %}"


def driver_side(cfg) -> tuple[PromptPin, dict[str, str]]:
    """What run_on_ray hands each worker: the pin taken when the input opened, the parts' metadata."""
    job = open_input(cfg, Path(cfg.output_dir))
    pin = PromptPin.of(cfg, job)
    with open_output(cfg, job, None) as out:
        return pin, dict(out.committer.metadata)


def job(model: str, tmp_path: Path, *extra: str):
    data = write_parquet(tmp_path / "in.parquet", [{"prompt": f"question {i}"} for i in range(4)])
    return compose_job(dummy_overrides(model, data, tmp_path / "out", "launcher=ray", "run.rows_per_part=2",
                                       "output.include_prompt=true", "sampling.max_new_tokens=2", *extra))


def test_a_worker_started_after_the_template_file_changed_renders_the_drivers_text(tiny_model, tmp_path):
    template = tmp_path / "chat.jinja2"
    template.write_text(OLD)
    cfg = job(tiny_model, tmp_path, f"dataset.chat_template={template}")
    pin, metadata = driver_side(cfg)
    template.write_text(NEW)  # edited while the job runs; a worker starts now (a replacement after a death)
    done = PartWorker(cfg, None, metadata, pin).run_part(1, 1)
    assert done.stats.rows == 2
    prompts = pq.read_table(tmp_path / "out" / "part-00001.parquet").column("rendered_prompt").to_pylist()
    assert prompts == ["OLD question 2\n", "OLD question 3\n"]


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_worker_that_reads_other_model_prompt_files_refuses_to_run(tiny_model, tmp_path, name):
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    cfg = job(str(model), tmp_path, "dataset.system_prompt=be brief")
    pin, metadata = driver_side(cfg)
    with open(model / name, "a") as f:
        f.write("\n ")  # the tokenizer a new worker loads is no longer the one the driver's rows were rendered by
    worker = PartWorker(cfg, None, metadata, pin)
    for call in (worker.identity, lambda: worker.run_part(0, 1)):
        with pytest.raises(ResumeMismatchError, match=rf"prompt_files\.{name}: was [0-9a-f]{{16}}, now") as refused:
            call()
        assert "restore those files and rerun to resume" in str(refused.value)
    assert not list((tmp_path / "out").glob("part-*.parquet"))


@pytest.mark.ray
@pytest.mark.slow
def test_a_requeued_parts_console_warning_shows_a_hostile_row_id_escaped(tiny_model, tmp_path):
    """run.on_bad_row=fail under launcher=ray: the driver's console warning for the failed part quotes the row's id
    and error; the CLI's console handler (commands/terminal.py ConsoleFormatter) escapes it."""
    pytest.importorskip("ray", reason="launcher=ray needs ray: pip install 'batchgen[ray]'")
    from tests.commands.test_terminal import HOSTILE, assert_safe
    from tests.conftest import run_cli

    rows = [{"uid": f"u{HOSTILE}", "prompt": ""}, {"uid": "ok", "prompt": "question"}]
    data = write_parquet(tmp_path / "in.parquet", rows)
    done = run_cli(dummy_overrides(tiny_model, data, tmp_path / "out", "dataset.id_column=uid", "launcher=ray",
                                   "launcher.num_workers=1", "launcher.max_attempts=2", "run.on_bad_row=fail"))
    assert done.returncode == 1, done.stderr[-3000:]
    console = done.stdout + done.stderr  # Hydra's console handler writes to stdout
    warned = [line for line in console.splitlines() if "part 0 failed on worker 0 (attempt 1 of 2)" in line]
    assert warned and "ux\\x1b]0;pwned\\x07\\x1b[2J\\u202etxt.exe\\x9b1m === row 2" in warned[0], console[-3000:]
    assert_safe(console)
