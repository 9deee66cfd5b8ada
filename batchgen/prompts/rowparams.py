"""Per-row sampling from columns: a row's own max_new_tokens, temperature, stop strings and constraint (a choice list,
or the name of one of sampling.schemas), each value checked per row. A bad value makes that row an error row
(`bad_max_new_tokens`, `bad_temperature`, `bad_stop`, `bad_choice`, `bad_schema`, `bad_value`, and `bad_n` for an n
above sampling.num_beams under beam search), never a dead job (any exception while reading a value is its row's
bad_value); a null value takes the job's setting. The logits processors' columns (dataset.KEY_column for each
sampling.PROCESSORS key) are checked as the sampling keys are. A row's value is data: a schema is an object, never
the path of a file to read, and a schema name only picks one of sampling.schemas. Knows columns and values; the
planner turns the settings into SampleParams.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import pyarrow as pa

from batchgen.constraints import Constraint, compile_problem, from_row
from batchgen.errors import ConfigError
from batchgen.reader import column_values
from batchgen.sampling import PROCESSOR_COLUMNS, PROCESSORS, TOKEN_LISTS, processor_value


@dataclass(slots=True)
class RowSettings:
    max_new_tokens: int
    temperature: float
    stop: tuple[str, ...]
    constraint: Optional[Constraint]
    top_p: float = 1.0
    n: int = 1  # samples of the row
    seed: Optional[int] = None  # the row's own job seed (its samples' seeds derive from it), else sampling.seed
    processors: dict[str, Any] = field(default_factory=dict)  # sampling.PROCESSORS key -> value, as SampleParams


MAX_ROW_N = 128  # a row's own n above this is a bad_value: its samples would crowd out every other row


def _beam_problem(row: RowSettings, num_beams: int) -> Optional[str]:
    """A row's own setting that deterministic beam search cannot honour (the job-level ones are refused by
    sampling.problems): an error row naming it, never a row generated as if the setting were not there."""
    why = f"beam search (sampling.num_beams={num_beams}) is deterministic and unconstrained"
    if row.temperature != 0.0:
        return f"bad_temperature: a row's temperature={row.temperature:g} under {why}; give it 0 or null"
    if row.stop:
        return f"bad_stop: a row's stop strings under {why}; leave them null"
    if row.constraint is not None:
        kind = "bad_choice" if row.constraint.kind == "choice" else "bad_schema"
        return f"{kind}: a row's {row.constraint.kind} constraint under {why}; leave it null"
    own = next((key for key, off in PROCESSORS.items() if row.processors.get(key, off) != off), None)
    return f"bad_value: a row's {own} under {why}; leave it null" if own else None


def _held_problem(row: RowSettings) -> Optional[str]:
    """A row's min_tokens with a constraint (one of them its own: the job's pair is refused by validate): min_tokens
    masks EOS, which a constrained sample needs the moment its constraint is complete."""
    held = row.processors.get("min_tokens", 0)
    if held and row.constraint is not None:
        return (f"bad_value: min_tokens={held} with a {row.constraint.kind} constraint: a constrained sample ends "
                f"when its constraint is complete")
    if row.processors.get("allowed_token_ids") and row.constraint is not None:
        return (f"bad_value: allowed_token_ids with a {row.constraint.kind} constraint: the constraint chooses the "
                f"tokens")
    return None


class RowParams:
    def __init__(self, dataset: Any, sampling: Any, unconstrained: Optional[str] = None, vocab: Optional[int] = None):
        """unconstrained: why the engine cannot apply a row's constraint (it does not constrain its output); such a
        row is its own bad_schema error, never generated unconstrained. vocab: the tokenizer's size, which a
        logit_bias token id must be under (sampling.logit_bias's: a ConfigError; a row's: its bad_value)."""
        self.ds = dataset
        self.sampling = sampling
        self.unconstrained = unconstrained
        self.vocab = vocab
        self.processors = sampling.processors()  # the job's, for rows without their own
        problems = [f"sampling.{key} {problem}" for key in (*TOKEN_LISTS, "logit_bias")
                    if (problem := self._vocab_problem(key, self.processors[key])) is not None]
        if problems:
            raise ConfigError(problems)
        self.constraint = sampling.constraint()  # the job's, for rows without their own
        self.schemas = sampling.named_schemas() if sampling.schemas else {}
        self._choices: dict[tuple[str, ...], Optional[str]] = {}  # choice list -> why it does not compile (None: ok)

    def settings(self, table: pa.Table, errors: list[Optional[str]]) -> list[RowSettings]:
        """Each row's settings; a bad value sets errors[row] (an earlier error is kept)."""
        s, ds = self.sampling, self.ds
        rows = [RowSettings(s.max_new_tokens, s.temperature, tuple(s.stop), self.constraint, s.top_p, s.n,
                            processors=dict(self.processors)) for _ in range(table.num_rows)]
        checks = ((ds.max_new_tokens_column, self._cap), (ds.temperature_column, self._temperature),
                  (ds.stop_column, self._stop), (ds.choice_column, self._choice), (ds.schema_column, self._schema),
                  (ds.top_p_column, self._top_p), (ds.n_column, self._n), (ds.seed_column, self._seed),
                  (ds.response_format_column, self._response_format),
                  *((getattr(ds, column), partial(self._processor, key)) for key, column in PROCESSOR_COLUMNS.items()))
        self._check_present(table)
        for column, check in checks:
            if not column:
                continue
            for row, value in enumerate(column_values(table, column)):  # a mixed-type JSONL column: as written
                if isinstance(value, float) and math.isnan(value):
                    value = None  # pandas' NaN for a missing number
                if value is None:
                    continue
                try:
                    problem = check(rows[row], value)
                except RecursionError:  # JSON text nested past what Python walks: its row's problem, not the job's
                    problem = f"bad_value: column {column!r}: {_shown(value)} is nested too deeply to read"
                except Exception as exc:  # noqa: BLE001 - a row's value is untrusted data: any failure is its row's
                    problem = f"bad_value: column {column!r}: {_shown(value)} cannot be read ({type(exc).__name__})"
                if problem and errors[row] is None:
                    errors[row] = problem
        for row, settings in enumerate(rows):
            errors[row] = errors[row] or _held_problem(settings) or (
                _beam_problem(settings, s.num_beams) if s.num_beams > 1 else None)
        return rows

    def _cap(self, row: RowSettings, value: Any) -> Optional[str]:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # pandas' float64 for an int column with NaN
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"bad_max_new_tokens: {value!r} is not a positive integer"
        row.max_new_tokens = min(row.max_new_tokens, value)
        return None

    def _temperature(self, row: RowSettings, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            return f"bad_temperature: {value!r} is not a number >= 0 (dataset.temperature_column)"
        row.temperature = float(value)
        return None

    def _stop(self, row: RowSettings, value: Any) -> Optional[str]:
        stops = _strings(value, single=True)
        if stops is None:
            return f"bad_stop: {_shown(value)} is not a string or a list of non-empty strings (dataset.stop_column)"
        row.stop = tuple(dict.fromkeys(row.stop + tuple(stops)))
        return None

    def _choice(self, row: RowSettings, value: Any) -> Optional[str]:
        choices = _strings(value, single=False)
        if not choices or len(set(choices)) != len(choices):
            return (f"bad_choice: {_shown(value)} is not a list of distinct non-empty strings "
                    f"(dataset.choice_column)")
        key = tuple(choices)
        if key not in self._choices:
            self._choices[key] = compile_problem(Constraint("choice", json.dumps(choices, ensure_ascii=False)))
        if self._choices[key]:
            return f"bad_choice: {self._choices[key]}"
        row.constraint = Constraint("choice", json.dumps(choices, ensure_ascii=False))
        return None

    def _schema(self, row: RowSettings, value: Any) -> Optional[str]:
        if not isinstance(value, str) or value not in self.schemas:
            return (f"bad_schema: {_shown(value)} is not one of sampling.schemas ({', '.join(sorted(self.schemas))}) "
                    f"(dataset.schema_column)")
        row.constraint = self.schemas[value]
        return None


    def _top_p(self, row: RowSettings, value: Any) -> Optional[str]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            return f"bad_value: top_p {value!r} is not a number in (0, 1] (dataset.top_p_column)"
        row.top_p = float(value)
        return None

    def _n(self, row: RowSettings, value: Any) -> Optional[str]:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ROW_N:
            return f"bad_value: n {value!r} is not an integer in [1, {MAX_ROW_N}] (dataset.n_column)"
        beams = self.sampling.num_beams
        if beams > 1 and value > beams:  # as sampling.n > num_beams is refused: the extra samples would be copies
            return (f"bad_n: n={value} is more than sampling.num_beams={beams} (beam search returns at most "
                    f"num_beams hypotheses per row)")
        row.n = value
        return None

    def _seed(self, row: RowSettings, value: Any) -> Optional[str]:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return f"bad_value: seed {value!r} is not an integer (dataset.seed_column)"
        row.seed = value
        return None

    def _check_present(self, table: pa.Table) -> None:
        """The logits processors' columns must exist (a ConfigError naming the key, not a KeyError mid-part)."""
        named = {key: getattr(self.ds, key) for key in PROCESSOR_COLUMNS.values()}
        missing = [f"dataset.{key}: column {column!r} not found (columns: {', '.join(table.column_names)})"
                   for key, column in named.items() if column and column not in table.column_names]
        if missing:
            raise ConfigError(missing)

    def _processor(self, key: str, row: RowSettings, value: Any) -> Optional[str]:
        """A row's logits processor setting, checked as sampling.KEY is; a logit_bias as an object, its JSON text, a
        struct (JSONL objects with different keys read as one: its null fields dropped) or an Arrow map."""
        if key in ("logit_bias", "bad_words", *TOKEN_LISTS) and isinstance(value, str):
            try:
                value = json.loads(value, object_pairs_hook=list)  # pairs: a key written twice is seen twice
            except ValueError:
                pass  # reported below as not a mapping or a list
        setting, problem = processor_value(key, value)
        problem = problem or self._vocab_problem(key, setting)
        if problem:
            return f"bad_value: {key} {problem} (dataset.{PROCESSOR_COLUMNS[key]})"
        row.processors[key] = setting
        return None

    def _vocab_problem(self, key: str, setting: Any) -> Optional[str]:
        """A logit_bias's or a token list's (TOKEN_LISTS) token id at or past the tokenizer's size (the setting's ids
        ascending), else None."""
        if key not in ("logit_bias", *TOKEN_LISTS) or self.vocab is None or not setting:
            return None
        last = setting[-1][0] if key == "logit_bias" else setting[-1]
        return None if last < self.vocab else f"has token id {last}, not one of the tokenizer's {self.vocab} ids"

    def _response_format(self, row: RowSettings, value: Any) -> Optional[str]:
        """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema (its schema)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return f"bad_schema: response_format {_shown(value)} is not JSON (dataset.response_format_column)"
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema" and isinstance(value.get("json_schema"), dict):
            schema = value["json_schema"].get("schema", {"type": "object"})
        else:
            return (f"bad_schema: response_format {_shown(value)} is not text, json_object or json_schema with a "
                    f"json_schema object (dataset.response_format_column)")
        if not isinstance(schema, dict):  # a string is not read as a path: a row's values are data
            return (f"bad_schema: response_format json_schema.schema must be a JSON schema object, not "
                    f"{type(schema).__name__} {_shown(schema)} (dataset.response_format_column)")
        if self.unconstrained:
            return f"bad_schema: response_format {kind}: {self.unconstrained}"
        constraint, problem = from_row("json_schema", json.dumps(schema, sort_keys=True))
        if problem:
            return f"bad_schema: response_format: {problem}"
        row.constraint = constraint
        return None


def _strings(value: Any, *, single: bool) -> Optional[list[str]]:
    """A list of non-empty strings from a list value (a JSON-text list too), or a lone string where `single`."""
    if isinstance(value, str):
        if value.startswith("["):
            try:
                value = json.loads(value)
            except ValueError:
                return [value] if single else None
        elif single and value:
            return [value]
        else:
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return list(value)
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
