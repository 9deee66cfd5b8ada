"""reader/hfds.py: a `datasets` dataset saved with save_to_disk read back (splits, limit, batches), its count and its
fingerprint, and the errors naming dataset.path or dataset.split."""

from __future__ import annotations

import pytest

from batchgen.errors import InputError
from batchgen.reader import DatasetConfig, open_reader
from batchgen.reader.hfds import HFReader
from tests.reader.conftest import read_all


def save_dict(path, **splits: list[str]) -> str:
    import datasets

    datasets.DatasetDict({name: datasets.Dataset.from_dict({"prompt": rows, "n": list(range(len(rows)))})
                          for name, rows in splits.items()}).save_to_disk(str(path))
    return str(path)


def test_hf_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "id": [5, 6, 7]}).save_to_disk(str(tmp_path / "ds"))
    cfg = DatasetConfig(path=str(tmp_path / "ds"), id_column="id", batch_rows=2)
    assert open_reader(cfg).count_rows() == 3
    ids, rows, _ = read_all(cfg)
    assert ids == ["5", "6", "7"] and [r["prompt"] for r in rows] == ["a", "b", "c"]


def test_batches_of_batch_rows_with_generated_ids_columns_and_limit(tmp_path):
    path = save_dict(tmp_path / "dd", train=["a", "b", "c", "d", "e"])
    reader = open_reader(DatasetConfig(path=path, batch_rows=2))
    assert isinstance(reader, HFReader) and reader.columns() == ["prompt", "n"]
    got = [(b.start, b.ids, b.table.column("prompt").to_pylist(), b.read_errors) for b in reader.iter_batches()]
    assert got == [(0, ["dd:0", "dd:1"], ["a", "b"], [None, None]), (2, ["dd:2", "dd:3"], ["c", "d"], [None, None]),
                   (4, ["dd:4"], ["e"], [None])]
    limited = DatasetConfig(path=path, batch_rows=2, limit=3)
    assert open_reader(limited).count_rows() == 3
    assert read_all(limited)[0] == ["dd:0", "dd:1", "dd:2"]
    assert open_reader(DatasetConfig(path=path, limit=99)).count_rows() == 5


def test_a_dataset_dict_reads_train_by_default_or_the_split_named(tmp_path):
    path = save_dict(tmp_path / "dd", train=["t0", "t1"], test=["x0"])
    assert [r["prompt"] for r in read_all(DatasetConfig(path=path))[1]] == ["t0", "t1"]
    test = DatasetConfig(path=path, split="test")
    assert open_reader(test).count_rows() == 1 and [r["prompt"] for r in read_all(test)[1]] == ["x0"]


def test_a_split_that_is_not_there_names_the_splits_there_are(tmp_path):
    path = save_dict(tmp_path / "dd", train=["t"], test=["x"])
    with pytest.raises(InputError, match=r"dataset.split: choose one of \['test', 'train'\] for .*dd$"):
        open_reader(DatasetConfig(path=path, split="validation")).columns()
    no_train = save_dict(tmp_path / "nt", a=["x"], b=["y"])  # no train split: the split must be named
    with pytest.raises(InputError, match=r"dataset.split: choose one of \['a', 'b'\]"):
        open_reader(DatasetConfig(path=no_train)).count_rows()


def test_a_directory_that_is_no_saved_dataset_is_an_input_error_naming_it(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match=r"dataset.path: cannot load HF dataset '.*plain'"):
        open_reader(DatasetConfig(path=str(tmp_path / "plain"), format="hf")).columns()


def test_the_fingerprint_is_the_datasets_own_not_a_file_digest(tmp_path):
    a = save_dict(tmp_path / "a", train=["a", "b"], test=["x"])
    b = save_dict(tmp_path / "b", train=["a", "c"])
    (fp,) = open_reader(DatasetConfig(path=a, split="test")).fingerprint()
    assert set(fp) == {"path", "split", "fingerprint"} and (fp["path"], fp["split"]) == (a, "test")
    train_a = open_reader(DatasetConfig(path=a)).fingerprint()[0]["fingerprint"]
    assert train_a and train_a != fp["fingerprint"]  # another split, another fingerprint
    assert open_reader(DatasetConfig(path=b)).fingerprint()[0]["fingerprint"] != train_a  # other rows
    assert open_reader(DatasetConfig(path=a)).fingerprint()[0]["fingerprint"] == train_a  # stable
