"""The files of a model or tokenizer directory that shape a prompt before the weights see it, by content: what the
manifest's model identity carries beside the weights (so a resume after an edited chat template or tokenizer is
refused like a changed model), and what a Ray worker compares with the driver's before it renders a row. Knows file
names and bytes, not tokenizers.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

# the chat template, the tokenizer's vocabulary and settings, special tokens, the generation defaults (EOS ids) and
# a processor's config: small, so hashed whole
PROMPT_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json", "tokenizer.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                "merges.txt", "spiece.model", "sentencepiece.bpe.model", "generation_config.json",
                "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
ADDITIONAL_TEMPLATES = "additional_chat_templates"  # transformers' named chat templates, one .jinja file each
KEYS = ("prompt_files", "tokenizer_files")  # engine.model's directory, engine.tokenizer's where it is another


def prompt_identity(model: str, tokenizer: Optional[str] = None) -> dict[str, dict[str, str]]:
    """`prompt_files`: each PROMPT_FILES file (and additional chat template) of the model directory by name, its
    sha256 (16 hex digits); `tokenizer_files`: the same of engine.tokenizer's directory where it is another local
    one. Empty for a hub id (it stands for itself, as in the model identity)."""
    out = {}
    model_dir = os.path.realpath(model) if os.path.isdir(model) else None
    if model_dir:
        out[KEYS[0]] = _digests(Path(model_dir))
    if tokenizer and os.path.isdir(tokenizer) and os.path.realpath(tokenizer) != model_dir:
        out[KEYS[1]] = _digests(Path(tokenizer))
    return out


def changed_files(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two prompt_identity()s, one line per file (`prompt_files.tokenizer.json: was ..., now
    ...`); empty where they are the same."""
    out = []
    for key in KEYS:
        old, new = recorded.get(key) or {}, now.get(key) or {}
        out += [f"{key}.{name}: was {old.get(name) or 'absent'}, now {new.get(name) or 'absent'}"
                for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]
    return out


def _digests(directory: Path) -> dict[str, str]:
    extra = directory / ADDITIONAL_TEMPLATES
    names = [name for name in PROMPT_FILES if (directory / name).is_file()]
    if extra.is_dir():
        names += sorted(f"{ADDITIONAL_TEMPLATES}/{p.name}" for p in extra.iterdir() if p.is_file())
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest()[:16] for name in names}
