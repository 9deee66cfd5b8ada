"""Where batchgen's Hydra config lives: the package's `batchgen.conf` once installed (a wheel, or the editable
install's mapping of the checkout's top-level conf/), else the checkout's conf/ beside the package (a source tree on
PYTHONPATH, as the GPU check runs it). Read by the config's composer and by `batchgen help`."""

from __future__ import annotations

from pathlib import Path


def conf_dir() -> Path:
    try:
        import batchgen.conf
    except ModuleNotFoundError:  # not installed: the source tree's conf/
        return Path(__file__).resolve().parent.parent / "conf"
    return Path(batchgen.conf.__file__).resolve().parent
