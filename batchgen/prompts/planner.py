"""The planner: cuts the input stream into parts, skips committed and other shards' parts, and turns
a part's rows into engine Requests (render, tokenize, fit to max_model_len, per-sample seeds).

Rows that cannot be generated become error rows here, before the engine sees them (docs/contract.md section 7).
Without a tokenizer (engine=openai's chat endpoint, whose server renders and counts) a prompt's "ids" are
placeholders, as many as its estimated tokens (characters / 4): never sent, only its length is used, and run.too_long
is left to the server (its refusal is the row's error).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple, Optional

import pyarrow as pa

from batchgen.engines import ENGINES
from batchgen.engines.base import estimate_tokens
from batchgen.errors import ConfigError, TooLongError
from batchgen.job import JobConfig
from batchgen.prompts.render import Renderer
from batchgen.prompts.rowparams import RowParams, RowSettings
from batchgen.reader import Reader, column_values
from batchgen.records import InputBatch, Part, PlannedPart, Request
from batchgen.sampling import Reasoning, SampleParams, derive_seed

log = logging.getLogger(__name__)
DUPLICATE_CHECK_ROWS = 2_000_000  # ids remembered for the duplicate-id count (about 100 bytes each)
PLACEHOLDER = 0  # a prompt's "token id" where no tokenizer counts (see the module's docstring)


class Measured(NamedTuple):
    texts: list[Optional[str]]  # rendered prompts (None on error)
    errors: list[Optional[str]]  # per row: why it is an error row
    settings: list[RowSettings]  # per row: cap, temperature, stops, constraint
    ids: list[list[int]]  # prompt token ids, untruncated ([] on error)
    messages: list[Optional[list[dict]]]  # per row, the chat messages rendered (None: a plain prompt or an error)


class Planner:
    def __init__(self, cfg: JobConfig, reader: Reader, renderer: Renderer, tokenizer: Any, existing: Any = None):
        self.cfg = cfg
        self.reader = reader
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.rows_per_part = cfg.rows_per_part
        self.total_rows = 0  # rows seen so far; the input's size once parts() is exhausted
        self.duplicate_ids = 0  # rows whose dataset.id_column value repeats an earlier row's (all parts, all shards)
        self._seen_ids: set[int] = set()  # hashes of the first DUPLICATE_CHECK_ROWS ids
        self.only: Optional[set[int]] = None  # a Ray worker's part: parts() yields these only
        self.existing = existing  # existing.Existing: ids run.skip_existing's output generated already
        self.share = cfg.share()
        spec = ENGINES.get(cfg.engine.name)
        unconstrained = (None if spec is None or spec.constraints else
                         f"engine={cfg.engine.name} does not constrain its output; use engine=hf or engine=vllm")
        # engine=openai's chat endpoint is sent each row's messages (the server renders them), not token ids
        self.sends_messages = cfg.engine.name == "openai" and getattr(cfg.engine, "endpoint", None) == "chat"
        # each row's cap, stops, constraint and logits processors (a logit_bias token id checked against the tokenizer)
        biased = bool(cfg.sampling.logit_bias or cfg.dataset.logit_bias_column)
        vocab = len(tokenizer) if biased and tokenizer is not None else None  # no tokenizer: the server checks ids
        self.row_params = RowParams(cfg.dataset, cfg.sampling, unconstrained, vocab=vocab)
        s = cfg.sampling
        self.reasoning = None if s.reasoning == "off" else Reasoning(
            end_ids=tuple(tokenizer(s.reasoning_end, add_special_tokens=False)["input_ids"]), start=s.reasoning_start,
            max_tokens=s.max_reasoning_tokens)

    # -- cutting the stream into parts ------------------------------------------------------------

    def parts(self, skip: set[int]) -> Iterator[Part]:
        """This shard's parts not in `skip`, in order. A seekable input (Parquet: row counts from the footers) is
        cut into parts from its metadata and only these parts' row groups are read; any other input is streamed
        and the other parts are read past, never rendered."""
        if getattr(self.reader, "seekable", False):
            yield from self._seek_parts(skip)
            return
        pending: list[InputBatch] = []
        buffered = 0
        index = 0
        for batch in self.reader.iter_batches():
            self.total_rows += batch.table.num_rows
            self._count_duplicates(batch.ids)
            pending.append(batch)
            buffered += batch.table.num_rows
            while buffered >= self.rows_per_part:
                part, pending, buffered = self._cut(index, pending, self.rows_per_part)
                if self._mine(index, skip):
                    yield part
                index += 1
        if buffered:
            part, _, _ = self._cut(index, pending, buffered)
            if self._mine(index, skip):
                yield part

    def _seek_parts(self, skip: set[int]) -> Iterator[Part]:
        self.total_rows = self.reader.count_rows() or 0  # known up front: the parts are cut from it
        size = self.rows_per_part
        for index in range(self.share.shard, self.total_parts, self.share.num_shards):
            if not self._mine(index, skip):
                continue
            batches = list(self.reader.iter_range(index * size, min((index + 1) * size, self.total_rows)))
            for batch in batches:
                self._count_duplicates(batch.ids)  # within the parts this run reads
            yield self._cut(index, batches, sum(b.table.num_rows for b in batches))[0]

    def _count_duplicates(self, ids: list[str]) -> None:
        """Duplicate ids are kept (each row still gets its own output rows); they are only counted and warned."""
        if self.cfg.dataset.id_column is None:
            return  # generated ids <file>:<row> are unique
        seen = self._seen_ids
        for row_id in ids:
            h = hash(row_id)
            if h in seen:
                if not self.duplicate_ids:
                    log.warning("dataset.id_column %r: id %r appears more than once; duplicates are kept as "
                                "separate rows and counted in the summary", self.cfg.dataset.id_column, row_id)
                self.duplicate_ids += 1
            elif len(seen) < DUPLICATE_CHECK_ROWS:
                seen.add(h)

    @property
    def total_parts(self) -> int:
        return -(-self.total_rows // self.rows_per_part)

    def _mine(self, index: int, skip: set[int]) -> bool:
        if self.only is not None:
            return index in self.only and index not in skip
        return self.share.owns(index) and index not in skip

    def _cut(self, index: int, pending: list[InputBatch], n: int) -> tuple[Part, list[InputBatch], int]:
        tables, ids, errors, taken = [], [], [], 0
        rest: list[InputBatch] = []
        for b in pending:
            if taken == n:
                rest.append(b)
                continue
            k = min(n - taken, b.table.num_rows)
            tables.append(b.table.slice(0, k))
            ids += b.ids[:k]
            errors += b.read_errors[:k]
            taken += k
            if k < b.table.num_rows:
                rest.append(InputBatch(b.start + k, b.table.slice(k), b.ids[k:], b.read_errors[k:]))
        start = pending[0].start
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        return Part(index=index, start=start, table=table, ids=ids, read_errors=errors), rest, sum(
            b.table.num_rows for b in rest)

    # -- turning a part into requests --------------------------------------------------------------

    def measure(self, part: Part) -> Measured:
        """A part's rows rendered, checked and tokenized (before any too_long policy): what plan() turns into
        requests, and what `batchgen plan` counts."""
        rendered = self.renderer.render(part.table)
        errors = [read or render for read, render in zip(part.read_errors, rendered.errors)]
        settings = self.row_params.settings(part.table, errors)  # per-row columns; a bad value errs that row
        ids = self._tokenize([t if e is None else None for t, e in zip(rendered.texts, errors)],
                             rendered.add_special_tokens)
        return Measured(rendered.texts, errors, settings, ids, rendered.messages)

    def plan(self, part: Part, max_model_len: int) -> PlannedPart:
        if self.cfg.task != "generate":
            return self._plan_read(part, max_model_len)
        rendered, errors, settings, ids, messages = self.measure(part)
        counts = tuple(settings[row].n for row in range(part.num_rows))  # samples per row (dataset.n_column)
        n = max((self.cfg.sampling.n, *counts))  # the key stride: sample s of row r is key r * n + s
        job_seed = self.cfg.sampling.seed
        # every sample's, error rows' included; a row's own seed (dataset.seed_column) stands for itself, as an
        # OpenAI request's: the same seed and prompt draw the same under any id
        seeds = [None if settings[row].temperature == 0.0 or s >= counts[row] else
                 derive_seed(job_seed, part.ids[row], s) if settings[row].seed is None else
                 derive_seed(settings[row].seed, "", s) for row in range(part.num_rows) for s in range(n)]
        requests: list[Request] = []
        skipped = frozenset(row for row in range(part.num_rows) if errors[row] is None and self.existing is not None
                            and part.ids[row] in self.existing)
        for row in range(part.num_rows):
            if errors[row] is not None or row in skipped:
                continue
            kept = self.cfg.sampling.truncate_prompt_tokens  # vLLM's: the prompt's last k tokens (a server's own)
            prompt = ids[row][-kept:] if kept and not self.sends_messages else ids[row]
            fitted, errors[row] = self.fit(prompt, settings[row].max_new_tokens, max_model_len, part.ids[row],
                                           cuttable=not self.sends_messages)
            if errors[row] is not None:
                continue
            params = self._params(settings[row], self._thinks(rendered[row]))
            chat = (messages[row] or [{"role": "user", "content": rendered[row]}]) if self.sends_messages else None
            requests += [Request(key=row * n + s, prompt_ids=fitted, seed=seeds[row * n + s], messages=chat,
                                 params=params if params.num_beams == 1 else replace(
                                     params, beam_rank=s, beam_count=counts[row])) for s in range(counts[row])]
        return PlannedPart(part=part, requests=requests, errors=errors, seeds=seeds, n=n, skipped=skipped,
                           counts=None if set(counts) == {n} else counts, prompts=self._prompts(rendered))

    def _plan_read(self, part: Part, max_model_len: int) -> PlannedPart:
        """task=loglik and task=embed: one request a row, nothing generated. loglik: the rendered prompt's tokens
        then, with dataset.text_column, the text's, which are scored given the prompt (without it, the prompt's own
        from its second token); no truncation: a row longer than max_model_len is scored in windows
        (engines/hf/loglik.py). embed: the rendered prompt's tokens (run.too_long applies), pooled."""
        m = self.measure(part)
        errors = list(m.errors)
        if self.cfg.task == "embed":
            return self._plan_embed(part, m, errors, max_model_len)
        if self.cfg.task == "decide":
            return self._plan_decide(part, m, errors, max_model_len)
        column = self.cfg.dataset.text_column
        texts = column_values(part.table, column) if column else [None] * part.num_rows
        requests = []
        for row in range(part.num_rows):
            if errors[row] is not None:
                continue
            if column is not None and (not isinstance(texts[row], str) or not texts[row]):
                errors[row] = ("empty_text" if texts[row] in (None, "") else
                               f"non_string_text: dataset.text_column holds a {type(texts[row]).__name__}")
                continue
            tail = self.tokenizer(texts[row], add_special_tokens=False)["input_ids"] if column else []
            ids = m.ids[row] + tail
            first = len(m.ids[row]) if column else 1
            if len(ids) <= first:
                errors[row] = "empty_text: no token to score"
                continue
            params = SampleParams(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                                  score_from=first)
            requests.append(Request(key=row, prompt_ids=ids, params=params, seed=None))
        return PlannedPart(part=part, requests=requests, errors=errors, seeds=[None] * part.num_rows, n=1,
                           prompts=self._prompts(m.texts))

    def _plan_embed(self, part: Part, m: Measured, errors: list[Optional[str]], max_model_len: int) -> PlannedPart:
        params = SampleParams(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False,
                              pooling=self.cfg.embed.pooling, normalize=self.cfg.embed.normalize)
        requests = []
        for row in range(part.num_rows):
            if errors[row] is None:
                fitted, errors[row] = self.fit(m.ids[row], 0, max_model_len, part.ids[row])
                if errors[row] is None:
                    requests.append(Request(key=row, prompt_ids=fitted, params=params, seed=None))
        return PlannedPart(part=part, requests=requests, errors=errors, seeds=[None] * part.num_rows, n=1,
                           prompts=self._prompts(m.texts))

    def _plan_decide(self, part: Part, m: Measured, errors: list[Optional[str]], max_model_len: int) -> PlannedPart:
        """task=decide: for every row, question and answer, one scored request: the row's rendered prompt, the
        question's prompt, then " answer" and EOS, scored from the answer on (EOS included, so an answer that is a
        prefix of another, "bug" and "bugfix", is not credited with the longer one's mass). The row's prompt is
        marked shared (all of it but its last token, whose state predicts the question's first): the engine prefills
        it once for all of them, and the row's answers (params.answers, its whole set) as one batch. A row whose
        prompt, longest question and answer exceed max_model_len is too_long."""
        questions, answers = self.questions()
        width = sum(len(a) for a in answers)
        longest = max(len(q) + max(map(len, opts)) for q, opts in questions)
        meta = tuple((q.name, q.kind, a, q.abstain_below) for q, a in zip(self.cfg.decide.questions, answers))
        requests = []
        for row in range(part.num_rows):
            if errors[row] is not None:
                continue
            base, j = m.ids[row], 0
            if len(base) + longest > max_model_len:
                errors[row] = (f"too_long: {len(base)} prompt tokens + {longest} of a question and its answer > "
                               f"engine.max_model_len={max_model_len}")
                continue
            every = tuple(tuple(base[-1:] + q_ids + option) for q_ids, opts in questions for option in opts)
            for q_ids, opts in questions:
                for option in opts:
                    params = SampleParams(max_new_tokens=0, temperature=0.0, top_p=1.0, top_k=0, stop=(),
                                          ignore_eos=False, score_from=len(base) + len(q_ids),
                                          shared=len(base) - 1, answers=every)
                    requests.append(Request(key=row * width + j, prompt_ids=base + q_ids + option, params=params,
                                            seed=None))
                    j += 1
        return PlannedPart(part=part, requests=requests, errors=errors, seeds=[None] * part.num_rows, n=1,
                           questions=meta, prompts=self._prompts(m.texts))

    def _prompts(self, texts: list[Optional[str]]) -> Optional[list[Optional[str]]]:
        """output.include_prompt: the rows' prompts as rendered (the engine's before any run.too_long cut), for the
        rendered_prompt column; None where the job does not write it."""
        return list(texts) if self.cfg.output.include_prompt else None

    def questions(self) -> tuple[list[tuple[list[int], list[list[int]]]], tuple[tuple[str, ...], ...]]:
        """Each question's prompt ids and its answers' ids (" answer" then EOS), and the answers as text."""
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        out, answers = [], []
        for q in self.cfg.decide.questions:
            opts = (q.options or ["yes", "no"]) if q.kind != "score" else [str(k) for k in range(1, q.levels + 1)]
            prompt = self.tokenizer(q.prompt, add_special_tokens=False)["input_ids"]
            out.append((prompt, [self.tokenizer(" " + o, add_special_tokens=False)["input_ids"] + eos for o in opts]))
            answers.append(tuple(opts))
        return out, tuple(answers)

    def check_answers(self, max_model_len: int) -> None:
        """task=decide, once the engine says its max_model_len: an answer whose tokens (" answer" then EOS) with its
        question's prompt leave no room for even a one-token row prompt would make every row a too_long error, so
        the job stops here, one ConfigError naming the option (or the question's prompt where it has no options)."""
        problems = []
        for i, (q, (q_ids, opts)) in enumerate(zip(self.cfg.decide.questions, self.questions()[0])):
            for j, ids in enumerate(opts):
                if len(q_ids) + len(ids) < max_model_len:
                    continue
                named = bool(q.options) and q.kind != "score"  # else yes/no or a score's levels: its prompt is long
                key, text = ((f"decide.questions[{i}].options[{j}]", q.options[j]) if named else
                             (f"decide.questions[{i}].prompt", q.prompt))
                problems.append(f"{key} (question {q.name!r}, {text[:40]!r}{'...' if len(text) > 40 else ''}): "
                                f"{len(ids)} answer tokens + {len(q_ids)} of the question's prompt leave no room "
                                f"for a row's prompt under engine.max_model_len={max_model_len}; shorten it, or "
                                f"raise engine.max_model_len")
        if problems:
            raise ConfigError(problems)

    def _tokenize(self, texts: list[Optional[str]], add_special_tokens: bool) -> list[list[int]]:
        todo = [i for i, t in enumerate(texts) if t is not None]
        out: list[list[int]] = [[] for _ in texts]
        if todo and self.tokenizer is None:  # placeholders: the estimate's length is all that is used
            return [[PLACEHOLDER] * estimate_tokens(t) if t is not None else [] for t in texts]
        if todo:
            encoded = self.tokenizer([texts[i] for i in todo], add_special_tokens=add_special_tokens)["input_ids"]
            for i, ids in zip(todo, encoded):
                out[i] = ids
        return out

    def fit(self, ids: list[int], cap: int, max_model_len: int, row_id: str,
            cuttable: bool = True) -> tuple[list[int], Optional[str]]:
        """Apply run.too_long: keep BOS and the prompt's tail, record the row as an error, or stop the job. A prompt
        sent as chat messages (engine=openai, engine.endpoint=chat) is not `cuttable`: it is skipped instead. Without
        a tokenizer the length is an estimate: the prompt is sent as it is, the server judges."""
        if self.tokenizer is None:
            return ids, None
        room = max_model_len - cap
        if len(ids) <= room:
            return ids, None
        why = f"too_long: {len(ids)} prompt tokens + {cap} new tokens > engine.max_model_len={max_model_len}"
        policy = self.cfg.run.too_long
        if policy == "fail":
            raise TooLongError(f"row {row_id}: {why} (run.too_long=fail; use truncate_left or skip to go on)")
        if policy == "skip" or room < 1 or not cuttable:
            return [], why
        bos = self.tokenizer.bos_token_id
        head = ids[:1] if bos is not None and ids and ids[0] == bos else []
        return head + ids[len(ids) - (room - len(head)):], None

    def _thinks(self, prompt: str) -> Optional[Reasoning]:
        """The row's Reasoning: every row's with sampling.reasoning=split; with auto, where the rendered prompt ends
        inside an open reasoning block (its chat template opened it)."""
        s = self.cfg.sampling
        if self.reasoning is None or s.reasoning == "auto" and prompt.rfind(s.reasoning_start) <= prompt.rfind(
                s.reasoning_end):
            return None
        return self.reasoning

    def _params(self, row: RowSettings, reasoning: Optional[Reasoning] = None) -> SampleParams:
        """The row's SampleParams; its min_tokens at most its own cap (as vLLM requires)."""
        s = self.cfg.sampling
        processors = row.processors | {"min_tokens": min(row.processors.get("min_tokens", 0), row.max_new_tokens)}
        return SampleParams(max_new_tokens=row.max_new_tokens, temperature=row.temperature, top_p=row.top_p,
                            top_k=s.top_k, stop=row.stop, ignore_eos=s.ignore_eos, constraint=row.constraint,
                            choice_scores=s.choice_scores and row.constraint is not None
                            and row.constraint.kind == "choice", logprobs=s.logprobs, reasoning=reasoning,
                            num_beams=s.num_beams, length_penalty=s.length_penalty, early_stopping=s.early_stopping,
                            **processors, **s.decoding())
