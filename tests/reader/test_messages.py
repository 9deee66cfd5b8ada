"""reader/messages.py: a message's content as OpenAI writes it (a string or a list of parts) as one string, text
parts joined; an image part refused as not supported yet, any other part named by its place and type. (The same
rule in a job's messages column: tests/prompts/test_render.py; in an openai_batch body: test_openai_batch.py.)"""

from __future__ import annotations

import pytest

from batchgen.reader.messages import content_text

WHERE = "messages[1].content"


def test_a_string_content_is_itself_and_text_parts_are_joined_without_a_separator():
    assert content_text("hi there", WHERE) == ("hi there", None)
    parts = [{"type": "text", "text": "Label this: "}, {"type": "text", "text": "the river\nrose"}]
    assert content_text(parts, WHERE) == ("Label this: the river\nrose", None)
    assert content_text([], WHERE) == ("", None)
    # a Parquet list of structs carries every part's fields, null where the part has none
    assert content_text([{"type": "text", "text": "a", "image_url": None}], WHERE) == ("a", None)


@pytest.mark.parametrize("kind", ["image_url", "input_image", "image"])
def test_an_image_part_is_refused_as_not_supported_yet_naming_its_place(kind):
    parts = [{"type": "text", "text": "what is this?"}, {"type": kind, kind: {"url": "https://x/cat.png"}}]
    text, why = content_text(parts, WHERE)
    assert text is None
    assert why.startswith(f"image parts are not supported yet: {WHERE}[1] has type '{kind}'")


@pytest.mark.parametrize("content, said", [
    (7, f"{WHERE} must be a string or a list of text parts (got int)"),
    (None, f"{WHERE} must be a string or a list of text parts (got NoneType)"),
    ({"type": "text", "text": "x"}, f"{WHERE} must be a string or a list of text parts (got dict)"),
    ([{"type": "input_audio"}], f"{WHERE}[0]: only text parts {{type: text, text: STRING}} are supported "
                                "(got type 'input_audio')"),
    (["plain"], f"{WHERE}[0]: only text parts {{type: text, text: STRING}} are supported (got no type)"),
    ([{"type": "text", "text": 3}], f"{WHERE}[0]: only text parts {{type: text, text: STRING}} are supported "
                                    "(got type 'text')"),
])
def test_any_other_content_says_what_and_where(content, said):
    assert content_text(content, WHERE) == (None, said)
