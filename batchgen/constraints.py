"""Structured outputs: the constraint a sample is generated under (sampling.json_schema, regex, choice, grammar),
checked before any model loads, and every constrained output checked after generation.

A Constraint is plain data (its kind and a canonical text), so that it rides on a request's SampleParams, goes
into the manifest, and is compiled by whichever engine runs it (the hf engine through xgrammar, vLLM through its
structured-output parameters). The check after generation is the engine's independent judge: a row whose text
does not parse or validate gets `invalid_output: ...` and keeps its text (docs/contract.md sections 4 and 7).
Knows JSON Schema, regexes and grammars; nothing about torch or engines.

A setting from the job's config may name a file (a schema's .json, a grammar's .ebnf); a value from a row
(`from_row`) is data and never names one. No schema reaches outside itself: a `$ref` must point into the schema
(`#`, `#/...`), which neither engine's grammar nor the output check would otherwise follow the same way, and the
check never fetches anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote

KINDS = ("json_schema", "regex", "choice", "grammar")
INVALID = "invalid_output"
REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
DATA_KEYS = ("const", "enum", "default", "examples")  # their values are instances, not schemas: no $ref there
NAMED_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
PROBES = (None, {}, [], "", 0)  # instances a schema is tried on when built: a $ref loop shows on one of them


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a constrained sample's text must be. `spec`: the schema as canonical JSON (keys sorted), the regex,
    the choices as a JSON list, or the EBNF grammar text (xgrammar's dialect, the one vLLM takes)."""

    kind: str
    spec: str

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.spec) if self.kind == "json_schema" else {}

    def ebnf_choice(self) -> str:
        """The choices as an EBNF grammar: one alternative per choice, each a JSON-escaped string literal."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)


def from_sampling(sampling: Any) -> tuple[Optional[Constraint], list[str]]:
    """The constraint sampling.* asks for (None without one), and every problem with it, naming the key:
    more than one constraint set, a schema file that is missing or not JSON, a schema, regex or grammar that
    does not compile."""
    given = [k for k in KINDS if getattr(sampling, k, None) not in (None, "", [])]
    if not given:
        return None, []
    if len(given) > 1:
        return None, [f"sampling: set one constraint at a time, not {' and '.join('sampling.' + k for k in given)}"]
    kind = given[0]
    value = getattr(sampling, kind)
    stamp = _file_stamp(value)  # a schema or grammar file edited between two jobs of one process is read again
    constraint, problem = _checked(kind, json.dumps(value, sort_keys=True, default=str), stamp, True)
    return (constraint, []) if problem is None else (None, [f"sampling.{kind}: {problem}"])


def _file_stamp(value: Any) -> Optional[tuple[int, int]]:
    try:
        info = Path(value).stat() if isinstance(value, str) and len(value) < 4096 else None
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size) if info is not None else None


@lru_cache(maxsize=64)
def _checked(kind: str, value: str, stamp: Optional[tuple[int, int]], files: bool
             ) -> tuple[Optional[Constraint], Optional[str]]:
    """The constraint built and compiled once per process for each setting (a schema file read once, where `files`
    allows one): validation, the manifest's hash and the planner all ask."""
    try:
        constraint = _build(kind, json.loads(value), files)
    except ValueError as exc:
        return None, str(exc)
    except RecursionError:  # a row's deeply nested schema is that row's problem, never the job's end
        return None, "nested too deeply to check"
    problem = compile_problem(constraint)
    return (None, problem) if problem else (constraint, None)


def from_row(kind: str, value: str) -> tuple[Optional[Constraint], Optional[str]]:
    """A row's own constraint from its JSON-text value (a schema, a choice list...), built and compiled once per
    process: (the constraint, None), or (None, why it cannot be used). A row's value is data: a string schema is
    refused, never opened as a file."""
    return _checked(kind, value, None, False)


def _build(kind: str, value: Any, files: bool) -> Constraint:
    if kind == "json_schema":
        if isinstance(value, str) and files:
            value = _read_json(value)
        if not isinstance(value, dict):
            what = ("a mapping or the path of a .json file holding one" if files
                    else "an object (a row's value is data, never the path of a file)")
            raise ValueError(f"a JSON schema is {what} (got {_shown(value)})")
        _check_schema(value)
        return Constraint(kind, json.dumps(value, sort_keys=True, ensure_ascii=False))
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or any(not isinstance(c, str) or not c for c in value):
            raise ValueError(f"a list of one or more non-empty strings (got {value!r})")
        if len(set(value)) != len(value):
            raise ValueError(f"the choices repeat one another: {list(value)!r}")
        return Constraint(kind, json.dumps(list(value), ensure_ascii=False))
    if not isinstance(value, str):
        raise ValueError(f"a string (got {value!r})")
    if kind == "grammar" and files and value.endswith((".ebnf", ".gbnf")) and "::=" not in value:
        try:
            value = Path(value).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read the grammar file {value}: {exc.strerror or exc}") from exc
    return Constraint(kind, value)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the schema file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc


def _check_schema(schema: dict[str, Any]) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ValueError(f"not a valid JSON schema at {where}: {exc.message}") from exc
    _check_refs(schema, schema, "")
    validator = _validator(json.dumps(schema, sort_keys=True, ensure_ascii=False))
    try:
        for probe in PROBES:
            next(iter(validator.iter_errors(probe)), None)
    except RecursionError:
        raise ValueError("its $refs loop without end (a schema that refers to itself must add a constraint at "
                         "each turn)") from None


def _check_refs(root: dict[str, Any], node: Any, where: str) -> None:
    """Every $ref under `node` points into `root`; names under properties, $defs... are names, not keywords."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_refs(root, item, f"{where}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in REF_KEYS and isinstance(value, str) and not _resolves(root, value):
            raise ValueError(f"{key} {_shown(value)} at {where or 'the top level'} points outside the schema: "
                             f"only references into it are followed (#, #/$defs/NAME); put the referenced schema "
                             f"under $defs")
        if key in NAMED_KEYS and isinstance(value, dict):
            for name, sub in value.items():
                _check_refs(root, sub, f"{where}/{key}/{name}")
        elif key not in DATA_KEYS and key not in REF_KEYS:
            _check_refs(root, value, f"{where}/{key}")


def _resolves(root: dict[str, Any], ref: str) -> bool:
    """Whether `ref` is `#` or a JSON pointer `#/...` that finds a schema in `root` (nothing else is resolved)."""
    if ref == "#":
        return True
    if not ref.startswith("#/"):
        return False
    node: Any = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return isinstance(node, (dict, bool))


def compile_problem(constraint: Constraint) -> Optional[str]:
    """Why the grammar library cannot compile the constraint (no tokenizer needed), or None."""
    try:
        grammar(constraint)
    except ImportError as exc:
        return f"constrained decoding needs xgrammar: pip install 'batchgen[constraints]' ({exc})"
    except RuntimeError as exc:  # xgrammar reports a bad schema, regex or grammar as a RuntimeError
        return f"does not compile: {str(exc).strip().splitlines()[-1]}"
    return None


@lru_cache(maxsize=64)
def grammar(constraint: Constraint) -> Any:
    """The constraint as an xgrammar Grammar. JSON allows no free whitespace (a model that keeps emitting spaces
    the grammar permits would loop to its token cap): compact separators `,` and `:`, as vLLM writes it with
    disable_any_whitespace."""
    import xgrammar as xgr

    if constraint.kind == "json_schema":
        return xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False, separators=(",", ":"),
                                         strict_mode=True)
    if constraint.kind == "regex":
        return xgr.Grammar.from_regex(constraint.spec)
    if constraint.kind == "choice":
        return xgr.Grammar.from_ebnf(constraint.ebnf_choice())
    return xgr.Grammar.from_ebnf(constraint.spec)


def check(constraint: Constraint, text: str, finish_reason: str) -> tuple[Optional[str], Optional[str]]:
    """(parsed, error) for a constrained sample's text: parsed is the validated value, a JSON schema's as strict JSON
    text (the object), a choice's, regex's or grammar's as the text itself (the label `positive`, not the JSON
    string `"positive"`); error is `invalid_output: ...` (truncated, not JSON, not valid) or None."""
    if finish_reason == "length":
        return None, f"{INVALID}: truncated: the sample reached its max_new_tokens before the constraint was complete"
    if constraint.kind == "json_schema":
        try:  # strict=False: a raw control character inside a string (xgrammar's JSON allows it) is read, and
            value = json.loads(text, strict=False)  # `parsed` then holds it escaped: parsed is always strict JSON
        except ValueError as exc:
            return None, f"{INVALID}: not JSON: {exc}"
        except RecursionError:  # `[[[[...` to the token cap: the sample's problem, never the job's end
            return None, f"{INVALID}: JSON nested too deeply to check"
        problem = schema_problem(constraint.spec, value)
        if problem:
            return None, f"{INVALID}: {problem}"
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None
    if constraint.kind == "choice":
        if text not in constraint.choices:
            return None, f"{INVALID}: {text[:80]!r} is none of the choices"
        return text, None
    if not accepts(constraint, text):
        return None, f"{INVALID}: {text[:80]!r} does not match sampling.{constraint.kind}"
    return text, None


def accepts(constraint: Constraint, text: str) -> bool:
    """Whether the whole of `text` is in the regex's or grammar's language, judged by the same library (and so the
    same regex dialect) that constrained the decoding, character by character, without a tokenizer."""
    from xgrammar.testing import _is_grammar_accept_string

    return bool(_is_grammar_accept_string(grammar(constraint), text))


def schema_problem(spec: str, value: Any) -> Optional[str]:
    from referencing.exceptions import Unresolvable

    try:
        error = next(iter(_validator(spec).iter_errors(value)), None)
    except (Unresolvable, RecursionError) as exc:  # a schema built here has neither; an output never kills the job
        return f"schema: cannot be checked: {type(exc).__name__}: {exc}"[:300]
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"schema: at {where}: {error.message}"[:300]


@lru_cache(maxsize=64)
def _validator(spec: str) -> Any:
    """The schema's validator, with a registry that retrieves nothing: jsonschema's default fetches a remote $ref
    (file:// included) through urllib."""
    import jsonschema
    from referencing import Registry

    schema = json.loads(spec)
    return jsonschema.validators.validator_for(schema)(schema, registry=Registry())


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
