"""A chat message's `content` as OpenAI writes it: one string, or a list of parts (`{"type": "text", "text": ...}`).

One rule for every reader of chat messages (a `dataset.messages_column` row, an `openai_batch` request body): text
parts are joined without a separator into the string a chat template takes; an image part is refused until images
are supported, any other part named by its type. Knows message content only, not roles, templates or files.
"""

from __future__ import annotations

from typing import Any, Optional

IMAGE_PARTS = ("image_url", "input_image", "image")  # OpenAI's chat and responses image parts, Hugging Face's


def content_text(content: Any, where: str) -> tuple[Optional[str], Optional[str]]:
    """The content as one string (text parts joined), or None and why not, naming the part at `where` (the
    content's place as the caller's user writes it, e.g. `messages[0].content`)."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        return None, f"{where} must be a string or a list of text parts (got {type(content).__name__})"
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            return None, (f"image parts are not supported yet: {where}[{j}] has type {kind!r}; give the "
                          f"message's text only (text parts or a string), or leave the row out")
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = f"type {kind!r}"[:60] if kind is not None else "no type"
            return None, f"{where}[{j}]: only text parts {{type: text, text: STRING}} are supported (got {shown})"
        texts.append(part["text"])
    return "".join(texts), None
