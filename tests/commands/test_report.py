"""batchgen report: a self-contained HTML page of a run (two shards, error rows, a retry), rendered in a real
headless Chromium; the screenshot must show the plots (pixels of the plots' own colours in several regions). The run
is on engine=dummy: the page reads the run's files, whichever engine wrote them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from batchgen.commands.report import COLORS, REPORT, history
from tests.conftest import corpus, dummy_overrides, run_cli, write_parquet


def browser() -> str:
    found = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
                 None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium in CI: .ci/run installs Debian's chromium package before the tests")
        pytest.skip("no headless browser here (apt-get install chromium); CI installs one")
    return found


@pytest.fixture(scope="module")
def reported(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    rows = [{"uid": f"r{i:02d}", "prompt": t} for i, t in enumerate(corpus(40, seed=9))]
    rows[3]["prompt"] = ""  # an empty_prompt row
    for i in (7, 21, 30):
        rows[i]["prompt"] = " ".join(corpus(10, seed=i))  # too long for max_model_len below
    data = write_parquet(tmp / "in.parquet", rows)
    out = tmp / "out"
    for shard in (0, 1):
        done = run_cli(dummy_overrides(tiny_model, data, out, "dataset.id_column=uid", "run.rows_per_part=5",
                                       "engine.max_model_len=64", "sampling.max_new_tokens=12",
                                       "run.too_long=skip", f"run.shard={shard}", "run.num_shards=2"))
        assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "_SUCCESS").exists()
    assert run_cli(["retry", str(out), "run.too_long=truncate_left"]).returncode == 0
    made = run_cli(["report", str(out)])
    assert made.returncode == 0, made.stderr[-2000:]
    return out, out / REPORT


def test_the_page_holds_every_section_and_loads_nothing_from_the_network(reported):
    out, page = reported
    text = page.read_text()
    for heading in ("Throughput over time", "Lengths", "Finish reasons", "Errors", "Shards", "Workers", "Retries",
                    "Model", "Config"):
        assert f"<h2>{heading}</h2>" in text
    assert text.count("<svg") == 4  # throughput, prompt and generation lengths, finish reasons
    assert "empty_prompt" in text and "r03" in text  # an error kind with its example row
    assert "_status.shard-00000.json" in text and "_status.shard-00001.json" in text
    assert "run.too_long=truncate_left" in text  # the retry
    assert "rows skipped (run.skip_existing)" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # no remote resource
    assert "<script" not in text and "<link" not in text
    workers = {(h["host"], h["pid"]) for h in history(out)}
    assert len(workers) == 2 and len(history(out)) == 8  # two shard processes, 8 parts


def _near(img, rgb, tol=0.06):
    import numpy as np

    return np.all(np.abs(img[:, :, :3] - np.array(rgb) / 255.0) < tol, axis=-1)


def test_a_headless_browser_renders_the_plots(reported, tmp_path, capsys):
    import matplotlib.image as mpimg

    chromium = browser()
    _, page = reported
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1200,2600", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120, check=False)
    assert shot.exists() and shot.stat().st_size > 10_000, "Chromium wrote no screenshot"
    img = mpimg.imread(shot)
    height, width = img.shape[:2]
    assert (height, width) == (2600, 1200)
    hexes = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in COLORS[:3]]
    plotted = [_near(img, rgb) for rgb in hexes]
    assert all(mask.sum() > 400 for mask in plotted), [int(m.sum()) for m in plotted]  # every plot colour drawn
    any_plot = plotted[0] | plotted[1] | plotted[2]
    bands = [bool(any_plot[y:y + 200].sum() > 100) for y in range(0, height, 200)]
    assert sum(bands) >= 3, bands  # plots in several regions of the page, not one blot
    with capsys.disabled():
        print(f"\nreport screenshot {shot}: plot-coloured pixels {[int(m.sum()) for m in plotted]}, "
              f"bands with plots {sum(bands)} of {len(bands)}")


def test_the_page_tells_the_truth(reported, tmp_path):
    """Time runs from the job's start (no point or bar left of zero) and the rate is the job's, in equal
    non-overlapping spans; error counts say which view they count; ten example rows, as a browser renders them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from batchgen.commands.report import _throughput

    out, page = reported
    fig, (ax1, ax2) = plt.subplots(1, 2)
    _throughput(ax1, ax2, history(out))
    assert all(min(line.get_xdata()) >= 0 for line in ax1.get_lines())
    bars = sorted((p.get_x(), p.get_x() + p.get_width()) for p in ax2.patches)
    assert bars[0][0] == 0 and all(a[1] <= b[0] + 1e-9 for a, b in zip(bars, bars[1:]))
    assert sum(p.get_height() * p.get_width() for p in ax2.patches) == pytest.approx(
        sum(h["made_tokens"] for h in history(out)))  # every token counted once, in the run that generated it
    plt.close(fig)
    text = page.read_text()
    assert "error samples (latest view: after retries)" in text and "before retries" in text
    dom = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    table = dom[dom.index("Example rows"):].split("</table>")[0]
    ids = re.findall(r"<td>(r\d\d)</td>", table)
    assert len(ids) == 10 and ids == sorted(ids), ids
    assert "finish_reason" in table and ("stop" in table or "length" in table)
