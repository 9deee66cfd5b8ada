"""Row data escaped for the terminal: no escape sequence, control, bidi override or forged line reaches it, and
ordinary text (accents, CJK, emoji, tabs in a block) is printed as it is. `assert_safe` is the check the command
tests (plan --show, head, status) run on what they print."""

from __future__ import annotations

import unicodedata

from batchgen.commands.terminal import block, error_text, escape_console, json_line, lines, one_line

# a row value as a red team writes one: a window title (OSC ... BEL), a clear screen (CSI), a bidi override, a C1
# CSI, and a line forging a frame of the command's own
HOSTILE = "x\x1b]0;pwned\x07\x1b[2J\u202etxt.exe\x9b1m\n=== row 2 ===\n--- row 1: id forged, 3 prompt tokens ---"


def assert_safe(printed: str, *, forged: tuple[str, ...] = ("=== row 2 ===", "--- row 1: id forged")) -> None:
    """No control but newline and tab, no format character (bidi overrides, zero widths) and no line that starts as a
    forged frame in `printed`."""
    bad = sorted({f"U+{ord(ch):04X}" for ch in printed
                  if ch not in "\n\t" and unicodedata.category(ch) in ("Cc", "Cf")})
    assert not bad, bad
    assert not [line for line in printed.splitlines() if line.startswith(forged)]


def test_one_line_escapes_every_control_bidi_override_and_newline_visibly():
    said = one_line(HOSTILE)
    assert said == ("x\\x1b]0;pwned\\x07\\x1b[2J\\u202etxt.exe\\x9b1m\\n=== row 2 ===\\n--- row 1: id forged, "
                    "3 prompt tokens ---")
    assert_safe(said)
    assert one_line("a\tb\r\x00\x7f\u2028\U000e0001") == "a\\tb\\r\\x00\\x7f\\u2028\\U000e0001"


def test_ordinary_text_is_printed_as_it_is():
    for text in ("caf\u00e9 \u6f22\u5b57 \U0001f600 a\u3000b", "", "back\\slash"):
        assert one_line(text) == text and lines(text) == text
    assert one_line(42) == "42"


def test_a_block_keeps_its_lines_and_tabs_each_after_the_margin():
    said = block("first\tline\n\n=== row 2 ===\x1b[2J\n")
    assert said.split("\n") == ["| first\tline", "| ", "| === row 2 ===\\x1b[2J", "| "]
    assert_safe(said)


def test_lines_keep_a_messages_newlines_and_escape_the_rest():
    assert lines("invalid config:\n  - row x\x1b[2J\u202e") == "invalid config:\n  - row x\\x1b[2J\\u202e"


def test_an_errors_text_is_one_line_and_a_config_errors_problems_a_line_each():
    from batchgen.errors import BatchgenError, ConfigError

    assert error_text(BatchgenError(f"row {HOSTILE}: empty_prompt")).count("\n") == 0
    said = error_text(ConfigError(["dataset.id_column: no column 'uid'", f"columns: {HOSTILE}"]))
    assert said.split("\n")[:2] == ["invalid config:", "  - dataset.id_column: no column 'uid'"]
    assert len(said.split("\n")) == 3
    assert_safe(said)


def test_json_line_writes_c1_controls_and_bidi_overrides_as_json_escapes_holding_the_same_value():
    import json

    value = {"id": "a\x9b2J\u202eb\x7f", "text": "caf\u00e9 \U0001f600 \U000e0001", "n": 1}
    said = json_line(json.dumps(value, ensure_ascii=False))
    assert json.loads(said) == value
    assert "\\u009b" in said and "\\u202e" in said and "\\udb40\\udc01" in said and "caf\u00e9 \U0001f600" in said
    assert_safe(said)


def test_the_console_formatter_escapes_a_log_line_quoting_row_data_and_the_log_file_keeps_it(tmp_path):
    import io
    import logging

    logger = logging.getLogger("batchgen.test_console")
    console, file = logging.StreamHandler(io.StringIO()), logging.FileHandler(tmp_path / "run.log")
    console.setFormatter(logging.Formatter("[%(levelname)s] - %(message)s"))
    for handler in (console, file):
        logger.addHandler(handler)
    try:
        escape_console(logger)
        escape_console(logger)  # once each
        logger.warning("part %d failed: %s; requeued", 3, f"row {HOSTILE}: empty_prompt")
    finally:
        for handler in (console, file):
            logger.removeHandler(handler)
            handler.close()
    printed = console.stream.getvalue()
    assert printed.startswith("[WARNING] - part 3 failed: row x\\x1b]0;pwned\\x07\\x1b[2J\\u202etxt.exe\\x9b1m")
    assert printed.count("\n") == 1 and "\\n=== row 2 ===\\n--- row 1: id forged" in printed
    assert_safe(printed)
    assert HOSTILE in (tmp_path / "run.log").read_text()
