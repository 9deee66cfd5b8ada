"""The built-in engine: torch + transformers, on CPU or GPU. Load and routing.

Loads the model (its device's backend, backends/, and quant/ decide how its linears run), then serves each
window: the Llama family by continuous batching over a slot KV cache (scheduler.py, the backend's stepper,
kvcache.py), any other architecture by static buckets (generic.py). Token choice and finishing live in
sampling/, device and dtype in device.py. It sees token ids and sampling params only; it knows nothing about
rows, files or parts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from batchgen.engines.base import EngineStats, Source, generate_by_stream, stream_windows
from batchgen.engines.hf import backends, device, loglik, prefix, quant
from batchgen.engines.hf.beam import BeamSearcher, with_beams
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.generic import GenericGenerator
from batchgen.engines.hf.sampling.sampler import Sampler, eos_ids
from batchgen.engines.hf.scheduler import Scheduler, SchedulerStats
from batchgen.engines.hf.score import ChoiceScorer, with_choice_scores
from batchgen.engines.hf.step import LlamaStepper, supports
from batchgen.errors import ModelLoadError
from batchgen.records import Request, Result

log = logging.getLogger(__name__)
# engine.threads=null: all cores, as torch counts them when the process starts (read once, at import), so an engine
# made after other code changed torch's threads (an earlier engine, a notebook cell) runs on the same count as a fresh
# process, and a row's scores (summed on those threads) are the same bits in both
ALL_CORES = torch.get_num_threads()


class HFEngine:
    def __init__(self, cfg: HFConfig, tokenizer: Any):
        if torch.get_num_threads() != (cfg.threads or ALL_CORES):
            torch.set_num_threads(cfg.threads or ALL_CORES)
        self.cfg = cfg
        self.device = device.resolve_device(cfg.device)
        self.backend = backends.for_device(self.device)  # the device's plan and stepper (backends/)
        self.dtype = quant.compute_dtype(cfg.quantization, self.device,
                                         device.resolve_dtype(cfg.dtype, self.device, device.model_config(cfg)))
        loaded = self.backend.load_dtype(cfg, self.dtype)
        self.tokenizer = tokenizer
        self.model = _load_model(cfg, self.device, loaded)  # from_pretrained, then quantized
        self.max_model_len = cfg.max_model_len or device.model_max_len(self.model.config)
        # the stepper serves every window where the model allows: fused GEMMs pay
        self.prepared = self.backend.prepare(self.model, cfg, self.dtype, loaded,
                                             serves_all=supports(self.model, self.max_model_len))
        self.activation_dtype = self.prepared.activation_dtype  # between the GEMMs and in the KV cache
        self.prepacked, self.fused = self.prepared.prepacked, self.prepared.fused
        self.governor = self.prepared.governor
        self.max_batch_tokens, self.max_batch_size = device.batch_defaults(self.device, cfg.max_batch_tokens,
                                                                           cfg.max_batch_size)
        self.eos_ids = eos_ids(self.model, tokenizer)
        vocab = getattr(self.model.config, "vocab_size", None)
        self.sampler = Sampler(tokenizer, self.eos_ids, self.device, vocab_size=vocab, ops=self.backend.draw_ops())
        self.fast = True  # continuous batching on the pre-allocated cache where the architecture allows
        self._stepper: Optional[LlamaStepper] = None
        self.counters = SchedulerStats()  # summed over every window and stream, live (stats())
        self.prefixes = prefix.for_config(cfg.prefix_cache, cfg.prefix_cache_mb)  # kept across windows
        self.pad_id = _first(tokenizer.pad_token_id, *sorted(self.eos_ids), 0)
        # built on first use: choice scores, beam search, task=loglik and task=embed
        self._scorer, self._beams, self._loglik = None, None, None
        between = "" if self.activation_dtype == self.dtype else f" (activations in {self.activation_dtype})"
        log.info("hf engine: %s on %s in %s%s (%s backend), max_batch_tokens=%d, max_batch_size=%d, %d linears "
                 "prepacked, %d fused q/k/v or gate/up projections", cfg.model, self.device, self.dtype, between,
                 self.backend.name, self.max_batch_tokens, self.max_batch_size, self.prepacked, self.fused)

    @functools.cached_property
    def quantization_scheme(self) -> Optional[str]:
        """What engine.quantization resolved to here (w8a8 or None), worked out once: the identity reports it."""
        return quant.scheme_in_use(self.model)

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(dataclasses.asdict(c), c.prefix_tokens_reused, c.kv_slots, c.kv_positions, c.kv_cache_bytes)

    def identity(self) -> dict[str, Any]:
        quantization = {"quantization": self.cfg.quantization} if self.cfg.quantization else {}
        if self.quantization_scheme:
            quantization["quantization_scheme"] = self.quantization_scheme
        prepacked = {"linear": "onednn-prepacked"} if self.prepacked else {}
        mixed = {} if self.activation_dtype == self.dtype else {
            "activations": str(self.activation_dtype).removeprefix("torch.")}
        return {"engine": "hf", "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                **mixed, **quantization, **prepacked}

    def close(self) -> None:
        if self.governor is not None and self.governor.threads != self.governor.full:
            torch.set_num_threads(self.governor.full)  # the process's setting as the engine found it
        del self.model

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        if not requests:
            return []
        if any(self.scorer.wants(r) or BeamSearcher.wants(r) or loglik.wants(r) for r in requests):
            return generate_by_stream(self.stream, requests, on_result)  # scored rows answered, the rest decoded
        max_len = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        if self.fast and supports(self.model, max_len):
            return self._continuous(lambda scheduler: scheduler.run(requests, on_result))
        generic = GenericGenerator(self.model, self.sampler, pad_id=self.pad_id, stats=self.counters,
                                   max_batch_tokens=self.max_batch_tokens, max_batch_size=self.max_batch_size)
        results = generic.run(requests, on_result)
        self.max_batch_tokens = generic.max_batch_tokens
        return results

    @torch.inference_mode()
    def stream(self, source: Source, on_result: Callable[[Result], None]) -> None:
        """Continuous batching across windows where the Llama-family step serves every request the model allows;
        otherwise one window at a time through the generic path. Rows that want choice scores are scored as they
        arrive (score.py)."""
        source = loglik.with_loglik(self.loglik_scorer, source, on_result)  # prefill-only rows, scored at once
        source, on_result = with_choice_scores(self.scorer, source, on_result)
        source = with_beams(self.beams, source, on_result)
        if self.fast and supports(self.model, self.max_model_len):
            self._continuous(lambda scheduler: scheduler.stream(source, on_result))
        else:
            stream_windows(self.generate, source, on_result)

    @property
    def beams(self) -> BeamSearcher:
        if self._beams is None:
            self._beams = BeamSearcher(self.model, self.tokenizer, self.eos_ids, self.device)
        return self._beams

    @property
    def scorer(self) -> ChoiceScorer:
        if self._scorer is None:
            eos = _first(self.tokenizer.eos_token_id, *sorted(self.eos_ids), self.pad_id)
            self._scorer = ChoiceScorer(self.tokenizer, eos_id=eos)
        return self._scorer

    def loglik_scorer(self) -> loglik.LoglikScorer:
        """task=loglik's scorer: on the Llama-family step where it serves the model, else the model's own forward."""
        if self._loglik is None:
            stepper = self.stepper if self.fast and supports(self.model, self.max_model_len) else None
            full = self.governor.full if self.governor is not None else None  # not the governor's cut for decoding
            self._loglik = loglik.LoglikScorer(self.model, stepper, self.device, max_len=self.max_model_len,
                                               max_batch_tokens=self.max_batch_tokens, threads=full)
        return self._loglik

    @property
    def stepper(self) -> LlamaStepper:
        if self._stepper is None:
            self._stepper = self.backend.stepper(self.model, self.prepared, self.dtype, self.cfg)  # once per engine
            log.info("hf engine decode step: %s", self._stepper.describe())
        return self._stepper

    def _continuous(self, run: Callable[[Scheduler], Any]) -> Any:
        scheduler = Scheduler(self.sampler, self.stepper, max_batch_tokens=self.max_batch_tokens,
                              max_batch_size=self.max_batch_size, prefixes=self.prefixes,
                              stats=self.counters,  # the engine's counters, counted as they happen (the status)
                              governor=self.governor)
        try:
            return run(scheduler)
        finally:
            self.max_batch_tokens = scheduler.max_batch_tokens  # keep an OOM backoff for the next window
            self.max_batch_size = scheduler.max_batch_size


def _load_model(cfg: HFConfig, on: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """quant.load_model; a pickled checkpoint that torch.load refuses under weights_only (the default since torch
    2.6: a pickled object other than tensors and plain containers) is a ModelLoadError (exit 2) saying what to do.
    transformers' own "Loading weights" bar stays off: the console is the job's bar and summary."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        return quant.load_model(cfg.model, scheme_name=cfg.quantization, device=on, dtype=dtype,
                                trust_remote_code=cfg.trust_remote_code)
    except pickle.UnpicklingError as exc:
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|$)", str(exc), re.MULTILINE)
        why = (found.group(1) if found else str(exc)).rstrip(".")
        files = ", ".join(sorted(p.name for p in Path(cfg.model).glob("*.bin"))) or "its .bin weights"
        raise ModelLoadError(
            f"engine.model: {cfg.model}: the pickled weights ({files}) do not load under torch.load(weights_only="
            f"True), which batchgen keeps on (unpickling can run code): {why}. Convert the checkpoint to safetensors "
            f"where you trust it (load it with weights_only=False, then save_pretrained(..., safe_serialization="
            f"True)), or use a safetensors copy of the model") from exc


def _first(*values: Optional[int]) -> int:
    return next(v for v in values if v is not None)

