"""The renderer on its own: a plain column as is, a `{column}` template, the chat template; every row that cannot
be rendered becomes that row's error (`kind: detail`, docs/contract.md section 7), never an exception."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from batchgen.errors import ConfigError
from batchgen.prompts.render import Renderer, template_fields
from batchgen.reader import DatasetConfig
from batchgen.reader.values import JSON_TEXT


class ChatTokenizer:
    """Records what apply_chat_template receives; renders `[role] content` lines plus the generation prompt."""

    chat_template = "{% for m in messages %}...{% endfor %}"

    def __init__(self, fail: Exception | None = None, text: str | None = None):
        self.calls: list[tuple[list[dict], dict]] = []
        self.fail = fail
        self.text = text

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(([dict(m) for m in messages], kwargs))
        if self.fail is not None:
            raise self.fail
        if self.text is not None:
            return self.text
        return "".join(f"[{m['role']}] {m['content']}\n" for m in messages) + "[assistant]"


class PlainTokenizer:
    chat_template = None


def render(table: pa.Table, tokenizer=None, render_row=None, **cfg):
    return Renderer(DatasetConfig(path="unused", **cfg), tokenizer or PlainTokenizer(), render_row).render(table)


def json_text_column(name: str, values: list) -> pa.Table:
    """A column as the JSONL reader keeps one whose values mix types: JSON text, marked batchgen.encoding=json."""
    field = pa.field(name, pa.string(), metadata=JSON_TEXT)
    return pa.Table.from_arrays([pa.array([None if v is None else json.dumps(v) for v in values])],
                                schema=pa.schema([field]))


def kinds(errors: list[str | None]) -> list[str | None]:
    return [e and e.split(":", 1)[0] for e in errors]


# -- plain prompts and templates --------------------------------------------------------------------------------


def test_a_plain_prompt_column_is_rendered_as_is():
    prompts = ["Hello  there\n", "  leading space", "{not a template}", "\u00e9\u6f22 ok"]
    out = render(pa.table({"prompt": prompts, "other": [1, 2, 3, 4]}))
    assert out.texts == prompts and out.errors == [None] * 4
    assert out.add_special_tokens is True


def test_another_prompt_column_is_used_when_named():
    out = render(pa.table({"prompt": ["no", "no"], "text": ["yes 1", "yes 2"]}), prompt_column="text")
    assert out.texts == ["yes 1", "yes 2"]


@pytest.mark.parametrize("value", ["", "   ", "\n\t ", None])
def test_an_empty_or_blank_prompt_is_an_empty_prompt_row(value):
    out = render(pa.table({"prompt": pa.array(["fine", value], pa.string())}))
    assert out.texts == ["fine", None] and out.errors == [None, "empty_prompt"]


def test_a_non_string_prompt_is_an_error_row():
    out = render(pa.table({"prompt": pa.array([3, 4], pa.int64())}))
    assert out.texts == [None, None] and out.errors == ["non_string_prompt: got int"] * 2


def test_mixed_type_prompts_are_judged_each_as_written():
    out = render(json_text_column("prompt", ["a text", 7, None, ["x"], {"k": "v"}, "7"]))
    assert out.texts == ["a text", None, None, None, None, "7"]
    assert out.errors == [None, "non_string_prompt: got int", "empty_prompt", "non_string_prompt: got list",
                          "non_string_prompt: got dict", None]


def test_a_template_fills_from_the_row_columns():
    table = pa.table({"q": ["why?", "how?"], "n": pa.array([0, 12], pa.int64()), "prompt": ["x", "y"]})
    out = render(table, template="Q: {q} ({n})\nA:")
    assert out.texts == ["Q: why? (0)\nA:", "Q: how? (12)\nA:"] and out.errors == [None, None]


def test_a_template_field_missing_or_null_is_a_bad_template_row():
    table = pa.table({"q": pa.array(["ok", None, ""], pa.string())})
    out = render(table, template="Q: {q}")
    assert out.texts == ["Q: ok", None, "Q: "] and out.errors[1] == "bad_template: field 'q' is missing or null"
    missing = render(table, template="Q: {q} C: {context}")
    assert missing.texts == [None] * 3
    assert missing.errors[0] == "bad_template: field 'context' is missing or null"
    assert kinds(missing.errors) == ["bad_template"] * 3


def test_a_template_that_fails_to_format_is_a_bad_template_row_not_an_exception():
    table = pa.table({"q": ["text"], "n": pa.array([5], pa.int64())})
    assert render(table, template="{q:d}").errors == ["bad_template: ValueError: Unknown format code 'd' for "
                                                      "object of type 'str'"]
    assert kinds(render(table, template="{q.missing}").errors) == ["bad_template"]
    assert kinds(render(table, template="{n[0]}").errors) == ["bad_template"]


def test_a_template_rendering_to_blank_is_an_empty_prompt():
    out = render(pa.table({"q": ["  ", "x"]}), template="{q}")
    assert out.errors == ["empty_prompt", None]


def test_template_fields_lists_the_top_level_columns():
    assert template_fields("Q: {q} {ctx.title} {items[0]} {{literal}} {n:>5}") == ["q", "ctx", "items", "n"]
    assert template_fields("no fields {{here}}") == []


def test_required_columns_name_what_the_rendering_reads():
    """A template needs no prompt column (its fields are checked against the input by preflight)."""
    def cfg(**kw) -> DatasetConfig:
        return DatasetConfig(path="unused", **kw)

    assert Renderer(cfg(), PlainTokenizer()).required_columns() == ["prompt"]
    assert Renderer(cfg(prompt_column="text"), PlainTokenizer()).required_columns() == ["text"]
    assert Renderer(cfg(messages_column="msgs"), ChatTokenizer()).required_columns() == ["msgs"]
    assert "prompt" not in Renderer(cfg(template="Q: {q}"), PlainTokenizer()).required_columns()
    assert Renderer(cfg(), PlainTokenizer(), render_row=lambda row: "x").required_columns() == []


# -- chat ------------------------------------------------------------------------------------------------------


def messages_table(values: list) -> pa.Table:
    return pa.table({"msgs": values})


def test_chat_messages_go_through_the_tokenizer_chat_template():
    tok = ChatTokenizer()
    msgs = [[{"role": "user", "content": "hi"}],
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}]]
    out = render(messages_table(msgs), tok, messages_column="msgs")
    assert out.texts == ["[user] hi\n[assistant]", "[user] a\n[assistant] b\n[user] c\n[assistant]"]
    assert out.errors == [None, None] and out.add_special_tokens is False  # the template placed the specials
    assert [c[0] for c in tok.calls] == msgs
    assert all(c[1] == {"tokenize": False, "add_generation_prompt": True} for c in tok.calls)


def test_only_role_and_content_reach_the_chat_template():
    tok = ChatTokenizer()
    render(json_text_column("msgs", [[{"role": "user", "content": "hi", "name": "bob", "extra": 1}]]), tok,
           messages_column="msgs")
    assert tok.calls[0][0] == [{"role": "user", "content": "hi"}]


def test_system_prompt_prepends_a_system_message():
    tok = ChatTokenizer()
    msgs = [[{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "own"}, {"role": "user", "content": "x"}]]
    out = render(messages_table(msgs), tok, messages_column="msgs", system_prompt="be brief")
    assert tok.calls[0][0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.calls[1][0] == msgs[1]  # a conversation with its own system message keeps it
    assert out.texts[0] == "[system] be brief\n[user] hi\n[assistant]"


def test_system_prompt_with_a_plain_prompt_column_renders_it_as_the_user_message():
    tok = ChatTokenizer()
    out = render(pa.table({"prompt": ["hello", "  "]}), tok, system_prompt="sys")
    assert tok.calls == [([{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}],
                          {"tokenize": False, "add_generation_prompt": True})]  # the blank row never reaches it
    assert out.errors == [None, "empty_prompt"] and out.add_special_tokens is False


@pytest.mark.parametrize("value, kind", [
    ("just a string", "bad_messages"), (["a", "b"], "bad_messages"),
    ({"role": "user", "content": "x"}, "bad_messages"),
    ([{"role": "user"}], "bad_messages"), ([{"content": "x"}], "bad_messages"),
    ([{"role": "user", "content": 5}], "bad_messages"), ([{"role": 1, "content": "x"}], "bad_messages"),
    ([{"role": "user", "content": "ok"}, "tail"], "bad_messages"), ([], "empty_prompt"), (None, "empty_prompt")])
def test_malformed_messages_are_error_rows(value, kind):
    tok = ChatTokenizer()
    out = render(json_text_column("msgs", [value, [{"role": "user", "content": "fine"}]]), tok,
                 messages_column="msgs")
    assert kinds(out.errors) == [kind, None] and out.texts[0] is None
    assert len(tok.calls) == 1  # only the good row reached the chat template


def test_content_as_openai_writes_it_renders_like_the_joined_string_and_an_image_part_is_its_rows_error(
        tokenizer, tmp_path):
    """A messages column (here a Parquet list of structs, as a dataset of OpenAI chat rows is saved) whose content is
    a list of text parts renders exactly as the same text given as one string; a row with an image part is that
    row's bad_messages, saying images are not supported yet and where the part is."""
    from tests.conftest import write_parquet
    from tests.reader.conftest import read_all

    def text(t):
        return {"type": "text", "text": t, "image_url": None}

    rows = [{"m": [{"role": "user", "content": [text("Label: "), text("the river rose")]}]},
            {"m": [{"role": "user", "content": [text("Label: the river rose")]}]},
            {"m": [{"role": "user", "content": [text("what is it?"),
                                                {"type": "image_url", "text": None, "image_url": {"url": "x"}}]}]}]
    path = write_parquet(tmp_path / "chat.parquet", rows)
    _, read, _ = read_all(DatasetConfig(path=str(path)))
    out = render(pa.Table.from_pylist(read), tokenizer, messages_column="m")
    want = tokenizer.apply_chat_template([{"role": "user", "content": "Label: the river rose"}], tokenize=False,
                                         add_generation_prompt=True)
    assert out.texts[:2] == [want, want] and out.errors[:2] == [None, None]
    assert out.messages[0] == [{"role": "user", "content": "Label: the river rose"}]
    assert out.texts[2] is None
    assert out.errors[2] == ("bad_messages: image parts are not supported yet: messages[0].content[1] has type "
                             "'image_url'; give the message's text only (text parts or a string), or leave "
                             "the row out")


def test_a_chat_template_that_raises_is_a_bad_template_row():
    tok = ChatTokenizer(fail=RuntimeError("jinja exploded"))
    out = render(messages_table([[{"role": "user", "content": "hi"}]]), tok, messages_column="msgs")
    assert out.errors == ["bad_template: chat template: RuntimeError: jinja exploded"] and out.texts == [None]


def test_a_chat_template_rendering_to_blank_is_an_empty_prompt():
    out = render(messages_table([[{"role": "user", "content": "hi"}]]), ChatTokenizer(text="  "),
                 messages_column="msgs")
    assert out.errors == ["empty_prompt"]


@pytest.mark.parametrize("key, kw", [("dataset.messages_column", {"messages_column": "msgs"}),
                                     ("dataset.system_prompt", {"system_prompt": "sys"})])
def test_chat_rendering_without_a_chat_template_is_a_config_error(key, kw):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Renderer(DatasetConfig(path="unused", **kw), PlainTokenizer())


# -- render_row ------------------------------------------------------------------------------------------------


def test_render_row_replaces_the_prompt_column_and_sees_every_column_decoded():
    seen = []

    def own(row):
        seen.append(dict(row))
        return f"Review: {row['text']} ({row['mixed']!r})"

    mixed = json_text_column("mixed", [1, "s"])
    table = pa.table({"text": ["good", "bad"], "prompt": ["ignored", "ignored"]})
    table = table.append_column(mixed.schema.field(0), mixed.column(0))
    out = render(table, render_row=own)
    assert out.texts == ["Review: good (1)", "Review: bad ('s')"] and out.errors == [None, None]
    assert seen[1] == {"text": "bad", "prompt": "ignored", "mixed": "s"}


def test_a_render_row_that_raises_costs_only_its_row():
    def own(row):
        if row["n"] == 1:
            raise KeyError("title")
        if row["n"] == 2:
            raise ValueError("no good")
        return f"n={row['n']}"

    out = render(pa.table({"n": pa.array([0, 1, 2, 3], pa.int64())}), render_row=own)
    assert out.texts == ["n=0", None, None, "n=3"]
    assert out.errors == [None, "bad_render: KeyError: 'title'", "bad_render: ValueError: no good", None]


def test_render_row_results_are_checked_like_prompts():
    values = {0: "ok", 1: "   ", 2: 42, 3: None}
    out = render(pa.table({"n": pa.array(list(values), pa.int64())}), render_row=lambda row: values[row["n"]])
    assert out.errors == [None, "empty_prompt", "non_string_prompt: got int", "empty_prompt"]


def test_render_row_messages_go_through_the_chat_template():
    tok = ChatTokenizer()

    def own(row):
        return [{"role": "user", "content": row["q"]}] if row["q"] else "not a list"

    out = render(pa.table({"q": ["hi", ""]}), tok, render_row=own, system_prompt="sys")
    assert tok.calls[0][0] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert out.texts[0] == "[system] sys\n[user] hi\n[assistant]"
    assert tok.calls[1][0] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "not a list"}]
    assert out.errors == [None, None]


def test_render_row_bad_messages_are_error_rows():
    out = render(pa.table({"q": ["x"]}), ChatTokenizer(), render_row=lambda row: [{"role": "user"}],
                 system_prompt="sys")
    assert kinds(out.errors) == ["bad_messages"]


def test_config_text_is_used_as_validate_made_it_and_row_values_are_data():
    """dataset.template and dataset.system_prompt hold their newlines once validated (texts.py): the renderer uses
    them as they are, so a backslash and an n the config kept (written `\\\\n`) stays one. A row's value with a
    backslash-n in it stays as written."""
    table = pa.table({"text": ["line one\\nstill one"], "q": ["why"]})
    out = render(table, template="Summarize:\n{text}\tend \\n")
    assert out.texts == ["Summarize:\nline one\\nstill one\tend \\n"]
    chat = ChatTokenizer()
    render(table, tokenizer=chat, system_prompt="Be brief.\nNo \\n lists.", prompt_column="q")
    assert chat.calls[0][0][0] == {"role": "system", "content": "Be brief.\nNo \\n lists."}


def test_the_quoted_template_the_docs_show_gives_a_newline(tiny_model, tmp_path):
    """docs/configuration.md's Parquet example, its template quoted for Hydra as the docs write it."""
    from batchgen.commands.compose import compose_checked
    from tests.conftest import job_overrides, write_parquet

    data = write_parquet(tmp_path / "in.parquet", [{"text": "a"}])
    cfg = compose_checked(job_overrides(tiny_model, data, tmp_path / "o", 'dataset.template="Summarize:\\n{text}"'))
    out = Renderer(cfg.dataset, PlainTokenizer()).render(pa.table({"text": ["a"]}))
    assert out.texts == ["Summarize:\na"]


# -- the job's own chat template and its variables ----------------------------------------------------------------

OWN_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<bot{% if enable_thinking is defined and not enable_thinking %} "
                "nothink{% endif %}>{% endif %}")


@pytest.fixture(scope="module")
def real_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_dataset_chat_template_replaces_the_tokenizers_and_its_kwargs_reach_it(real_tokenizer, tmp_path):
    """The job's template (text, or a .jinja file) and chat_template_kwargs go to transformers' own
    apply_chat_template: the text equals what it renders with them."""
    msgs = [[{"role": "user", "content": "hi"}]]
    want = real_tokenizer.apply_chat_template(msgs[0], tokenize=False, add_generation_prompt=True,
                                              chat_template=OWN_TEMPLATE, enable_thinking=False)
    assert want == "<user>hi<bot nothink>"
    out = render(messages_table(msgs), real_tokenizer, messages_column="msgs", chat_template=OWN_TEMPLATE,
                 chat_template_kwargs={"enable_thinking": False})
    assert out.texts == [want] and out.add_special_tokens is False
    (tmp_path / "own.jinja").write_text(OWN_TEMPLATE)
    out = render(messages_table(msgs), real_tokenizer, messages_column="msgs",
                 chat_template=str(tmp_path / "own.jinja"))
    assert out.texts == ["<user>hi<bot>"]
    default = render(messages_table(msgs), real_tokenizer, messages_column="msgs",
                     chat_template_kwargs={"enable_thinking": False})  # the tokenizer's own template, kwargs in
    assert default.texts == [real_tokenizer.apply_chat_template(msgs[0], tokenize=False, add_generation_prompt=True)]


def test_a_chat_template_alone_turns_on_chat_rendering_even_for_a_tokenizer_without_one(real_tokenizer):
    import copy

    base = copy.deepcopy(real_tokenizer)
    base.chat_template = None  # a base model's tokenizer
    out = render(pa.table({"prompt": ["x"]}), base, chat_template=OWN_TEMPLATE)
    assert out.texts == ["<user>x<bot>"] and out.add_special_tokens is False


def test_an_unreadable_template_file_and_a_template_without_a_tokenizer_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"dataset\.chat_template='.*missing\.jinja': cannot read"):
        Renderer(DatasetConfig(path="unused", chat_template=str(tmp_path / "missing.jinja")), ChatTokenizer())
    for kw, key in (({"chat_template": OWN_TEMPLATE}, "dataset.chat_template"),
                    ({"chat_template_kwargs": {"enable_thinking": False}}, "dataset.chat_template_kwargs")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " is applied by a local tokenizer"):
            Renderer(DatasetConfig(path="unused", messages_column="msgs", **kw), None)


@pytest.mark.parametrize("name", ["chat.jinja2", "chat.JINJA", "chat.jinja.txt", "chat_template"])
def test_a_chat_template_file_is_read_whatever_its_name_ends_in(real_tokenizer, tmp_path, name):
    """A value that names an existing file is that file's text, never the path rendered as every row's prompt."""
    (tmp_path / name).write_text(OWN_TEMPLATE)
    table = pa.table({"prompt": ["hi"]})
    out = render(table, real_tokenizer, chat_template=str(tmp_path / name))
    assert out.errors == [None] and out.texts == render(table, real_tokenizer, chat_template=OWN_TEMPLATE).texts
    assert name not in out.texts[0]


@pytest.mark.parametrize("value, why", [("{tmp}/chat.jinja2", "cannot read the template file: no such file"),
                                        ("{tmp}/chat.jinja", "cannot read the template file: no such file"),
                                        ("chat.JINJA", "cannot read the template file: no such file"),
                                        ("templates/chatml", "cannot read the template file: no such file"),
                                        ("chatml", "is neither an existing file nor a Jinja template")])
def test_a_chat_template_that_is_no_file_and_no_jinja_text_is_refused_naming_the_key(tmp_path, value, why):
    value = value.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as refused:
        Renderer(DatasetConfig(path="unused", chat_template=value), ChatTokenizer())
    assert f"dataset.chat_template={value!r}" in str(refused.value) and why in str(refused.value)
    assert render(pa.table({"prompt": ["hi"]}), ChatTokenizer(), chat_template="{{ messages[0].content }}!").texts


def test_the_chat_template_is_part_of_the_runs_fingerprint_by_its_text(tmp_path):
    """An edited template file is another run (the resume guard refuses to mix them); an output written before
    the key existed keeps its fingerprint."""
    from batchgen.job import JobConfig
    from batchgen.output.manifest import output_config

    template = tmp_path / "own.jinja"
    template.write_text(OWN_TEMPLATE)
    before = output_config(JobConfig(name="x"))["dataset"]
    assert "chat_template" not in before and "chat_template_kwargs" not in before
    cfg = JobConfig(name="x")
    cfg.dataset.chat_template = str(template)
    first = output_config(cfg)["dataset"]["chat_template"]
    template.write_text(OWN_TEMPLATE + " ")
    assert first == OWN_TEMPLATE and output_config(cfg)["dataset"]["chat_template"] != first


def test_a_chat_template_looping_for_ever_costs_its_row_within_the_time_limit(real_tokenizer):
    """A template with nested loops without end (here for one row only) is that row's bad_template once it has run
    dataset.render_timeout_s CPU seconds (prompts/budget.py); the rows before and after it render."""
    import time

    spin = ("{% if messages[0].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}x"
            "{% endfor %}{% endfor %}{% endif %}")
    start = time.monotonic()
    out = render(pa.table({"prompt": ["a", "spin", "b"]}), real_tokenizer, chat_template=spin + OWN_TEMPLATE,
                 render_timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert out.texts == ["<user>a<bot>", None, "<user>b<bot>"]
    assert out.errors[1].startswith("bad_template: chat template: ran past dataset.render_timeout_s=0.5 CPU seconds")
