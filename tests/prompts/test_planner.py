"""The planner on its own: parts cut at exactly rows_per_part rows in input order whatever the read batches,
sharding and skips, and plan(): one request per sample, seeds, too_long policies, per-row caps, duplicate ids."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engines.base import EngineConfig
from batchgen.errors import TooLongError
from batchgen.job import JobConfig, RunConfig
from batchgen.prompts.planner import Planner
from batchgen.prompts.render import Renderer
from batchgen.reader import DatasetConfig, open_reader
from batchgen.records import InputBatch
from batchgen.sampling import SamplingConfig, derive_seed
from tests.conftest import write_jsonl, write_parquet

BOS = 1


class FakeTokenizer:
    """Whitespace words -> ids (stable per instance), BOS prepended with add_special_tokens; records its calls."""

    bos_token_id: int | None = BOS
    chat_template = "fake"

    def __init__(self, bos: int | None = BOS):
        self.bos_token_id = bos
        self.vocab: dict[str, int] = {}
        self.calls: list[tuple[list[str], bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.vocab.setdefault(w, 10 + len(self.vocab)) for w in text.split()]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict:
        self.calls.append((list(texts), add_special_tokens))
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"


class ListReader:
    """A reader that yields the given tables as batches, numbered across batches like the real readers."""

    def __init__(self, tables: list[pa.Table], ids: list[str] | None = None):
        self.tables = tables
        self.ids = ids

    def iter_batches(self):
        start = 0
        for t in self.tables:
            ids = self.ids[start:start + t.num_rows] if self.ids else [f"r{start + i}" for i in range(t.num_rows)]
            yield InputBatch(start=start, table=t, ids=ids, read_errors=[None] * t.num_rows)
            start += t.num_rows


def job(data: str = "unused", *, rows_per_part: int = 4, shard: int = 0, num_shards: int = 1,
        too_long: str = "truncate_left", **sampling) -> JobConfig:
    return JobConfig(name="t", engine=EngineConfig(name="dummy", model="m"), dataset=DatasetConfig(path=data),
                     sampling=SamplingConfig(**sampling),
                     run=RunConfig(rows_per_part=rows_per_part, shard=shard, num_shards=num_shards,
                                   too_long=too_long))


def planner_over(cfg: JobConfig, tokenizer=None, reader=None) -> Planner:
    tokenizer = tokenizer or FakeTokenizer()
    reader = reader or open_reader(cfg.dataset)
    return Planner(cfg, reader, Renderer(cfg.dataset, tokenizer), tokenizer)


def prompts(n: int) -> list[dict]:
    return [{"prompt": f"row {i} says hello", "k": i} for i in range(n)]


# -- cutting the stream into parts ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("rows, rows_per_part, batch_rows", [
    (10, 4, 1), (10, 4, 3), (10, 4, 4), (10, 4, 5), (10, 4, 100), (12, 4, 5), (12, 3, 7), (3, 5, 2), (1, 1, 1)])
def test_parts_are_cut_at_rows_per_part_in_input_order_whatever_the_batch_size(tmp_path, fmt, rows, rows_per_part,
                                                                               batch_rows):
    """Every part but the last holds exactly rows_per_part rows; the last the remainder; starts and ids run on."""
    path = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, prompts(rows))
    else:
        pq.write_table(pa.Table.from_pylist(prompts(rows)), path, row_group_size=3)  # batches end at row groups
    cfg = job(str(path), rows_per_part=rows_per_part)
    cfg.dataset.batch_rows = batch_rows
    planner = planner_over(cfg)
    parts = list(planner.parts(skip=set()))
    sizes = [rows_per_part] * (rows // rows_per_part) + ([rows % rows_per_part] if rows % rows_per_part else [])
    assert [p.num_rows for p in parts] == sizes
    assert [p.index for p in parts] == list(range(len(sizes)))
    assert [p.start for p in parts] == [k * rows_per_part for k in range(len(sizes))]
    for p in parts:
        assert p.table.num_rows == p.num_rows == len(p.read_errors)
        assert p.table.column("k").to_pylist() == list(range(p.start, p.start + p.num_rows))
        assert p.ids == [f"in.{fmt}:{i}" for i in range(p.start, p.start + p.num_rows)]
    assert planner.total_rows == rows and planner.total_parts == len(sizes)


def test_uneven_and_empty_batches_are_regrouped_into_exact_parts():
    """Batches of 3, 0, 1, 7 and 2 rows (an empty one among them) still give parts of 4, 4, 4 and 1 rows."""
    sizes, rows = [3, 0, 1, 7, 2], iter(range(100))
    tables = [pa.table({"prompt": [f"p{next(rows)}" for _ in range(n)]}) for n in sizes]
    planner = Planner(job(rows_per_part=4), ListReader(tables), None, None)
    parts = list(planner.parts(skip=set()))
    assert [p.num_rows for p in parts] == [4, 4, 4, 1]
    assert [p.table.column("prompt").to_pylist() for p in parts] == [
        [f"p{i}" for i in range(k, min(k + 4, 13))] for k in range(0, 13, 4)]
    assert [p.ids[0] for p in parts] == ["r0", "r4", "r8", "r12"] and [p.start for p in parts] == [0, 4, 8, 12]
    assert planner.total_rows == 13 and planner.total_parts == 4


def test_total_rows_and_parts_count_the_whole_input_once_exhausted():
    planner = Planner(job(rows_per_part=5), ListReader([pa.table({"prompt": ["x"] * 11})]), None, None)
    assert planner.total_rows == 0 and planner.total_parts == 0
    assert len(list(planner.parts(skip={0, 1, 2}))) == 0  # every part skipped: the input is still read to its end
    assert planner.total_rows == 11 and planner.total_parts == 3


def test_an_empty_input_gives_no_part():
    planner = Planner(job(), ListReader([pa.table({"prompt": pa.array([], pa.string())})]), None, None)
    assert list(planner.parts(skip=set())) == [] and planner.total_rows == 0 and planner.total_parts == 0


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7])
def test_shards_get_exactly_their_parts_and_together_all_of_them(tmp_path, num_shards):
    """Shard k of N gets parts with index % N == k, with the same rows as an unsharded run; the union is all."""
    data = write_jsonl(tmp_path / "in.jsonl", prompts(23))
    every = {p.index: p for p in planner_over(job(str(data))).parts(skip=set())}
    assert sorted(every) == list(range(6))
    seen: list[int] = []
    for shard in range(num_shards):
        planner = planner_over(job(str(data), shard=shard, num_shards=num_shards))
        mine = list(planner.parts(skip=set()))
        assert [p.index for p in mine] == [k for k in range(6) if k % num_shards == shard]
        for p in mine:
            assert (p.start, p.ids) == (every[p.index].start, every[p.index].ids)
            assert p.table.equals(every[p.index].table)
        assert planner.total_rows == 23 and planner.total_parts == 6  # other shards' parts are read past
        seen += [p.index for p in mine]
    assert sorted(seen) == list(range(6))


def test_skipped_parts_are_not_yielded_and_the_rest_keep_their_rows(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", prompts(23))
    parts = list(planner_over(job(str(data), shard=1, num_shards=2)).parts(skip={1, 2, 4}))
    assert [p.index for p in parts] == [3, 5]
    assert [(p.start, p.num_rows) for p in parts] == [(12, 4), (20, 3)]


def test_duplicate_ids_are_counted_over_all_parts_and_shards_and_kept(tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", [{"uid": u, "prompt": "p"} for u in "abacbad"])
    cfg = job(str(data), rows_per_part=2, shard=1, num_shards=2)
    cfg.dataset.id_column = "uid"
    planner = planner_over(cfg)
    parts = list(planner.parts(skip=set()))
    assert [p.ids for p in parts] == [["a", "c"], ["d"]]  # shard 1: parts 1 and 3; the duplicates stay rows
    assert planner.duplicate_ids == 3  # a (twice more) and b (once more), in parts this shard does not own too
    generated = planner_over(job(str(data), rows_per_part=2))
    list(generated.parts(skip=set()))
    assert generated.duplicate_ids == 0  # no id column: generated ids are unique


# -- plan(): requests, seeds, errors --------------------------------------------------------------------------


def planned_first_part(tmp_path, rows: list[dict], cfg_edit=None, *, tokenizer=None, max_model_len: int = 1000,
                       **kw):
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    cfg = job(str(data), rows_per_part=len(rows), **kw)
    if cfg_edit:
        cfg_edit(cfg)
    planner = planner_over(cfg, tokenizer)
    part = next(iter(planner.parts(skip=set())))
    return planner.plan(part, max_model_len), planner


def test_plan_makes_one_request_per_sample_keyed_row_times_n_plus_sample(tmp_path):
    tok = FakeTokenizer()
    planned, _ = planned_first_part(tmp_path, prompts(4), tokenizer=tok, n=3, temperature=0.7, seed=5,
                                    max_new_tokens=6, top_p=0.9, top_k=7, stop=["END"])
    assert planned.n == 3
    assert [r.key for r in planned.requests] == list(range(12))
    for r in planned.requests:
        row = r.key // 3
        assert r.prompt_ids == tok.encode(f"row {row} says hello")
        assert (r.params.max_new_tokens, r.params.temperature, r.params.top_p, r.params.top_k, r.params.stop) == (
            6, 0.7, 0.9, 7, ("END",))
        assert r.seed == derive_seed(5, planned.part.ids[row], r.key % 3)
    assert len({r.seed for r in planned.requests}) == 12  # every sample its own seed
    assert tok.calls[0][1] is True  # plain prompts are tokenized with the special tokens (BOS)


def test_seeds_depend_only_on_job_seed_row_id_and_sample(tmp_path):
    """Two planners (and another sharding / rows_per_part) give the same seed to the same (row id, sample)."""
    data = write_jsonl(tmp_path / "in.jsonl", prompts(9))

    def seeds_by_key(cfg: JobConfig) -> dict[tuple[str, int], int | None]:
        planner = planner_over(cfg)
        out = {}
        for part in planner.parts(skip=set()):
            planned = planner.plan(part, 1000)
            for i, seed in enumerate(planned.seeds):
                out[part.ids[i // planned.n], i % planned.n] = seed
        return out

    base = seeds_by_key(job(str(data), n=2, temperature=1.0, seed=11))
    assert len(base) == 18 and len(set(base.values())) == 18
    assert seeds_by_key(job(str(data), n=2, temperature=1.0, seed=11)) == base
    other = seeds_by_key(job(str(data), rows_per_part=2, shard=1, num_shards=2, n=2, temperature=1.0, seed=11))
    assert other and all(base[k] == v for k, v in other.items())
    assert set(seeds_by_key(job(str(data), n=2, temperature=1.0, seed=12)).values()).isdisjoint(base.values())


def test_greedy_samples_have_no_seed(tmp_path):
    planned, _ = planned_first_part(tmp_path, prompts(3), n=2, temperature=0.0)
    assert planned.seeds == [None] * 6 and [r.seed for r in planned.requests] == [None] * 6


def test_error_rows_get_no_request_but_keep_their_seeds(tmp_path):
    rows = [{"prompt": "fine"}, {"prompt": "   "}, {"prompt": "also fine"}]
    planned, _ = planned_first_part(tmp_path, rows, n=2, temperature=0.5, seed=3)
    assert planned.errors[0] is None and planned.errors[2] is None
    assert planned.errors[1].startswith("empty_prompt")
    assert [r.key for r in planned.requests] == [0, 1, 4, 5]
    assert planned.seeds[2:4] == [derive_seed(3, planned.part.ids[1], s) for s in (0, 1)]
    assert len(planned.seeds) == 6 and None not in planned.seeds


def test_a_read_error_wins_over_the_render_error(tmp_path):
    data = tmp_path / "in.jsonl"
    write_jsonl(data, [{"prompt": "fine"}, b"{not json", {"prompt": "ok"}])
    planner = planner_over(job(str(data)))
    planned = planner.plan(next(iter(planner.parts(skip=set()))), 1000)
    assert planned.errors[0] is None and planned.errors[2] is None
    assert planned.errors[1].startswith("malformed_json: line 2")
    assert [r.key for r in planned.requests] == [0, 2]


def long_rows() -> list[dict]:
    return [{"prompt": "short one"}, {"prompt": " ".join(f"w{i}" for i in range(30))}]


def test_truncate_left_keeps_bos_and_the_tail_and_fits_the_model(tmp_path):
    tok = FakeTokenizer()
    planned, _ = planned_first_part(tmp_path, long_rows(), tokenizer=tok, max_model_len=12, max_new_tokens=4)
    assert planned.errors == [None, None]
    short, long = planned.requests
    assert short.prompt_ids == tok.encode("short one")  # a prompt that fits is left alone
    full = tok.encode(long_rows()[1]["prompt"])
    assert len(full) == 31 and full[0] == BOS
    assert long.prompt_ids == [BOS] + full[-7:]  # room = 12 - 4 = 8: BOS and the last 7 tokens
    assert len(long.prompt_ids) + long.params.max_new_tokens == 12


def test_truncate_left_without_bos_keeps_just_the_tail(tmp_path):
    tok = FakeTokenizer(bos=None)
    planned, _ = planned_first_part(tmp_path, long_rows(), tokenizer=tok, max_model_len=12, max_new_tokens=4)
    assert planned.requests[1].prompt_ids == tok.encode(long_rows()[1]["prompt"])[-8:]


def test_truncate_left_with_no_room_for_any_prompt_is_a_too_long_row(tmp_path):
    planned, _ = planned_first_part(tmp_path, long_rows(), max_model_len=4, max_new_tokens=4)
    assert all(e.startswith("too_long: ") for e in planned.errors) and planned.requests == []


def test_too_long_skip_makes_an_error_row_and_keeps_the_others(tmp_path):
    planned, _ = planned_first_part(tmp_path, long_rows(), max_model_len=12, max_new_tokens=4, n=2,
                                    temperature=0.5, too_long="skip")
    assert planned.errors[0] is None
    assert planned.errors[1] == "too_long: 31 prompt tokens + 4 new tokens > engine.max_model_len=12"
    assert [r.key for r in planned.requests] == [0, 1]


def test_too_long_fail_raises_naming_the_row(tmp_path):
    with pytest.raises(TooLongError, match=r"in\.jsonl:1: too_long.*run\.too_long=fail"):
        planned_first_part(tmp_path, long_rows(), max_model_len=12, max_new_tokens=4, too_long="fail")


def test_a_lower_row_cap_leaves_more_room_for_the_prompt(tmp_path):
    """room = max_model_len - the row's own cap: a row capped at 2 new tokens keeps 10 prompt tokens of 12."""
    rows = [dict(r, cap=c) for r, c in zip(long_rows(), [None, 2])]
    tok = FakeTokenizer()

    def edit(cfg):
        cfg.dataset.max_new_tokens_column = "cap"

    planned, _ = planned_first_part(tmp_path, rows, edit, tokenizer=tok, max_model_len=12, max_new_tokens=4)
    assert [r.params.max_new_tokens for r in planned.requests] == [4, 2]
    assert planned.requests[1].prompt_ids == [BOS] + tok.encode(rows[1]["prompt"])[-9:]


def caps_of(values: list, default: int = 8) -> tuple[list[int | None], list[str | None]]:
    """Per row: the requests' max_new_tokens (None for an error row) and the row's error, over an Arrow column."""
    table = pa.table({"prompt": [f"p {i}" for i in range(len(values))], "cap": values})
    cfg = job(rows_per_part=len(values), max_new_tokens=default)
    cfg.dataset.max_new_tokens_column = "cap"
    planner = Planner(cfg, ListReader([table]), Renderer(cfg.dataset, FakeTokenizer()), FakeTokenizer())
    planned = planner.plan(next(iter(planner.parts(skip=set()))), 1000)
    by_row = {r.key: r.params.max_new_tokens for r in planned.requests}
    return [by_row.get(i) for i in range(len(values))], planned.errors


def test_row_caps_lower_the_default_and_never_raise_it():
    caps, errors = caps_of(pa.array([3, None, 50, 8, 1], pa.int64()))
    assert caps == [3, 8, 8, 8, 1] and errors == [None] * 5


def test_integral_floats_are_caps_and_nan_is_no_cap():
    """pandas writes an int column with gaps as float64 with NaN: 4.0 caps at 4, NaN means the default."""
    caps, errors = caps_of(pa.array([4.0, math.nan, None, 2.0], pa.float64()))
    assert caps == [4, 8, 8, 2] and errors == [None] * 4


@pytest.mark.parametrize("values, bad", [
    (pa.array([2.5, 3.0], pa.float64()), "2.5"), (pa.array([0, 3], pa.int64()), "0"),
    (pa.array([-4, 3], pa.int64()), "-4"), (pa.array(["7", "x"], pa.string()), "'7'"),
    (pa.array([True, False], pa.bool_()), "True")])
def test_a_bad_cap_is_a_bad_max_new_tokens_error_row(values, bad):
    caps, errors = caps_of(values)
    assert caps[0] is None
    assert errors[0] == f"bad_max_new_tokens: {bad} is not a positive integer"
    assert (caps[1] is None) == (errors[1] is not None)


def test_mixed_type_cap_column_from_jsonl_is_read_as_written(tmp_path):
    """A JSONL cap column mixing ints, strings and booleans is JSON text; each value is judged as written."""
    rows = [{"prompt": "a", "cap": 3}, {"prompt": "b", "cap": "5"}, {"prompt": "c", "cap": True},
            {"prompt": "d", "cap": None}, {"prompt": "e", "cap": 99}]

    def edit(cfg):
        cfg.dataset.max_new_tokens_column = "cap"

    planned, _ = planned_first_part(tmp_path, rows, edit, max_new_tokens=8)
    assert [e and e.split(":")[0] for e in planned.errors] == [None, "bad_max_new_tokens", "bad_max_new_tokens",
                                                               None, None]
    assert [r.params.max_new_tokens for r in planned.requests] == [3, 8, 8]


def test_an_earlier_error_is_kept_over_a_bad_cap():
    table = pa.table({"prompt": ["", "ok"], "cap": pa.array([-1, -1], pa.int64())})
    cfg = job(rows_per_part=2)
    cfg.dataset.max_new_tokens_column = "cap"
    planner = Planner(cfg, ListReader([table]), Renderer(cfg.dataset, FakeTokenizer()), FakeTokenizer())
    planned = planner.plan(next(iter(planner.parts(skip=set()))), 1000)
    assert planned.errors[0] == "empty_prompt" and planned.errors[1].startswith("bad_max_new_tokens")


def test_chat_prompts_are_tokenized_without_adding_special_tokens_again(tmp_path):
    tok = FakeTokenizer()

    def edit(cfg):
        cfg.dataset.system_prompt = "be brief"

    planned, _ = planned_first_part(tmp_path, prompts(2), edit, tokenizer=tok)
    assert tok.calls[-1] == (["<system> be brief <user> row 0 says hello <assistant>",
                              "<system> be brief <user> row 1 says hello <assistant>"], False)
    assert BOS not in planned.requests[0].prompt_ids


def test_parquet_input_is_planned_with_file_row_ids(tmp_path):
    """The same planning over Parquet input: ids `<file>:<row>` and one request per row."""
    data = write_parquet(tmp_path / "in.parquet", prompts(5))
    planner = planner_over(job(str(data), rows_per_part=5))
    planned = planner.plan(next(iter(planner.parts(skip=set()))), 1000)
    assert planned.part.ids == [f"in.parquet:{i}" for i in range(5)] and len(planned.requests) == 5
