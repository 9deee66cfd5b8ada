"""The built-in engine: torch + transformers, on CPU or GPU.

Owns device and dtype choice, length bucketing under a token budget, the decode loop with the KV
cache, per-sample seeded sampling, EOS and stop strings. It sees token ids and sampling params only;
it knows nothing about rows, files or parts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, Optional

import torch

from batchgen.engines import cpu_dtype, cpu_kernels, cpu_linear, cpu_runtime, quant
from batchgen.engines.base import EngineConfig
from batchgen.engines.llama_step import LlamaStepper, fuse_projections, supports
from batchgen.engines.scheduler import Scheduler, SchedulerStats, halve_on_oom
from batchgen.records import Request, Result
from batchgen.sampling import SampleParams, find_stop

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULTS = {  # (max_batch_tokens, max_batch_size) per device type; rows per part: job.ROWS_PER_PART
    "cpu": (8192, 64),
    "cuda": (65536, 256),
}


cpu_has_fast_bf16 = cpu_runtime.has_native_bf16  # the flag; engine.dtype=auto measures instead (cpu_dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_config: Any = None) -> torch.dtype:
    """An explicit engine.dtype as given; auto: bf16 (else fp16) on CUDA, and on CPU the dtype measured faster for
    the model's linears (cpu_dtype: once per CPU kind and shape, cached)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return cpu_dtype.fastest_dtype(cpu_dtype.model_features(model_config))


class HFEngine:
    def __init__(self, cfg: EngineConfig, tokenizer: Any):
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = quant.compute_dtype(cfg.quantization, self.device,
                                         resolve_dtype(cfg.dtype, self.device, _model_config(cfg)))
        self.activation_dtype = self.dtype  # what flows between the GEMMs and sits in the KV cache
        quantized_bf16 = self.quantized_bf16_gemms(cfg)
        if quantized_bf16:  # int8/int4 weights, float32 between them: batchgen's kernels take float32
            self.activation_dtype = torch.float32
        self.tokenizer = tokenizer
        self.model = quant.load_model(cfg.model, scheme_name=cfg.quantization, device=self.device,
                                      dtype=self.activation_dtype,
                                      trust_remote_code=cfg.trust_remote_code)  # from_pretrained, then quantized
        self.max_model_len = cfg.max_model_len or _model_max_len(self.model.config)
        self.prepacked = self.fused = 0
        serves_all = supports(self.model, self.max_model_len)  # the stepper serves every window: fused GEMMs pay
        if self.mixed_bf16_pays(cfg):
            self.prepacked, self.fused = cpu_linear.mixed_bf16(self.model, fuse_projections if serves_all else None)
            self.activation_dtype = torch.float32
        elif self.device.type == "cpu" and cfg.prepack and not cfg.quantization and cpu_linear.available(self.dtype):
            if serves_all:
                self.fused = fuse_projections(self.model, cpu_linear.pack_concatenated)
            self.prepacked = self.fused + cpu_linear.pack_linears(self.model)
        elif self.device.type == "cpu" and cfg.quantization in ("int8", "int4") and serves_all:
            self.fused = fuse_projections(self.model, quant.concatenate)
        if quantized_bf16:  # after fusing: the fused modules are new
            quant.set_gemm_dtype(self.model, torch.bfloat16)
        if self.device.type == "cpu":  # after loading: memory freed while loading or quantizing goes back to the OS
            cpu_runtime.keep_freed_memory()
        budget, size = DEFAULTS["cuda" if self.device.type == "cuda" else "cpu"]
        self.max_batch_tokens = cfg.max_batch_tokens or budget
        self.max_batch_size = cfg.max_batch_size or size
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        self.eos_ids = _eos_ids(self.model, tokenizer)
        self.fast = True  # continuous batching on the pre-allocated cache where the architecture allows
        self._stepper: Optional[LlamaStepper] = None
        self.stats = EngineStats()
        self.pad_id = _first(tokenizer.pad_token_id, *sorted(self.eos_ids), 0)
        between = "" if self.activation_dtype == self.dtype else f" (activations in {self.activation_dtype})"
        log.info("hf engine: %s on %s in %s%s, max_batch_tokens=%d, max_batch_size=%d, %d linears prepacked for "
                 "oneDNN, %d fused q/k/v or gate/up projections", cfg.model, self.device, self.dtype, between,
                 self.max_batch_tokens, self.max_batch_size, self.prepacked, self.fused)

    def mixed_bf16_pays(self, cfg: EngineConfig) -> bool:
        """bf16 GEMMs with batchgen's float32 kernels between them (cpu_linear.mixed_bf16): a bf16 model on a CPU
        with native bf16 (the flag: on an emulating CPU the pure bf16 path stays as it was measured), where the
        kernels are built and oneDNN can prepack bf16 weights."""
        return (self.device.type == "cpu" and self.dtype == torch.bfloat16 and cfg.prepack and not cfg.quantization
                and cpu_has_fast_bf16() and cpu_kernels.load() is not None and cpu_linear.available(torch.bfloat16))

    def quantized_bf16_gemms(self, cfg: EngineConfig) -> bool:
        """int8/int4 in bf16 on CPU through batchgen's kernels: the model computes in float32 (the kernels for few
        rows take float32), and each quantized linear runs its dequantized GEMM (prefill) in bf16."""
        return (self.device.type == "cpu" and cfg.quantization in ("int8", "int4") and self.dtype == torch.bfloat16
                and cpu_kernels.load() is not None)

    def identity(self) -> dict[str, Any]:
        quantization = {"quantization": self.cfg.quantization} if self.cfg.quantization else {}
        prepacked = {"linear": "onednn-prepacked"} if self.prepacked else {}
        mixed = {} if self.activation_dtype == self.dtype else {
            "activations": str(self.activation_dtype).removeprefix("torch.")}
        return {"engine": "hf", "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                **mixed, **quantization, **prepacked}

    def close(self) -> None:
        del self.model

    @torch.inference_mode()
    def generate(self, requests: list[Request], on_result: Optional[Callable[[Result], None]] = None
                 ) -> list[Result]:
        if not requests:
            return []
        max_len = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        if self.fast and supports(self.model, max_len):
            if self._stepper is None:
                # built once per engine; around bf16 GEMMs the cache is bf16, as a bf16 model's would be
                self._stepper = LlamaStepper(self.model, self.activation_dtype, self.dtype)
                log.info("hf engine decode step: %s", self._stepper.describe())
            scheduler = Scheduler(self, self._stepper, max_batch_tokens=self.max_batch_tokens,
                                  max_batch_size=self.max_batch_size)
            results = scheduler.run(requests, on_result)
            self.max_batch_tokens = scheduler.max_batch_tokens  # keep an OOM backoff for the next window
            self.max_batch_size = scheduler.max_batch_size
            self.stats.add(scheduler.stats)
            return results
        return self._generate_generic(requests, on_result)

    def _generate_generic(self, requests: list[Request], on_result: Optional[Callable[[Result], None]]
                          ) -> list[Result]:
        """Any architecture: length-sorted static buckets through the model's own forward and DynamicCache."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt_ids))
        results: list[Optional[Result]] = [None] * len(requests)
        for bucket in self._buckets(order, requests):
            for i, result in zip(bucket, self._generate_bucket_or_halve([requests[i] for i in bucket])):
                results[i] = result
                if on_result is not None:
                    on_result(result)
        return results  # type: ignore[return-value]

    def _generate_bucket_or_halve(self, reqs: list[Request]) -> list[Result]:
        """On out-of-memory, halve the budget and generate the bucket in halves (logged, counted)."""
        def on_oom(rows: int) -> None:
            self.stats.oom_backoffs += 1
            self.max_batch_tokens = max(self.max_batch_tokens // 2, 1)
            log.warning("out of memory generating %d rows; engine.max_batch_tokens lowered to %d and retrying",
                        rows, self.max_batch_tokens)

        parts = halve_on_oom(len(reqs), lambda start, stop: self._generate_bucket(reqs[start:stop]), on_oom)
        return [result for part in parts for result in part]

    # -- what the scheduler asks of the engine ---------------------------------------------------

    def generator(self, req: Request) -> Optional[torch.Generator]:
        return None if req.params.greedy else self._generator(req.seed)

    def pick(self, logits: torch.Tensor, reqs: list[Request], generators: list[Optional[torch.Generator]]
             ) -> list[int]:
        return pick_tokens(logits, [r.params for r in reqs], generators)

    def _buckets(self, order: list[int], requests: list[Request]) -> list[list[int]]:
        buckets: list[list[int]] = []
        current: list[int] = []
        for i in order:
            width = max(len(requests[current[0]].prompt_ids) if current else 0, len(requests[i].prompt_ids))
            if current and ((len(current) + 1) * width > self.max_batch_tokens or len(current) >= self.max_batch_size):
                buckets.append(current)
                current = []
            current.append(i)
        if current:
            buckets.append(current)
        return buckets

    def _generate_bucket(self, reqs: list[Request]) -> list[Result]:
        """Prefill the bucket left-padded, then decode; a row leaves the batch the step it finishes."""
        from transformers import DynamicCache

        ids, mask, positions = self._left_pad(reqs)  # [B, T] each
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, positions, cache)  # [B, V]
        generators = [self._generator(r.seed) if not r.params.greedy else None for r in reqs]
        generated: list[list[int]] = [[] for _ in reqs]
        reasons: list[Optional[str]] = [None] * len(reqs)
        active = list(range(len(reqs)))  # rows of `reqs` still in the batch
        next_pos = positions[:, -1] + 1  # [B]
        while True:
            tokens = pick_tokens(logits, [reqs[a].params for a in active], [generators[a] for a in active])
            keep = []
            for j, a in enumerate(active):
                generated[a].append(tokens[j])
                reasons[a] = self.finish_reason(reqs[a].params, generated[a])
                if reasons[a] is None:
                    keep.append(j)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[index]
                active = [active[j] for j in keep]
                tokens = [tokens[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            step_ids = torch.tensor(tokens, device=self.device)[:, None]
            logits = self._forward(step_ids, mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return [self.make_result(r, g, reason) for r, g, reason in zip(reqs, generated, reasons)]

    def _left_pad(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for b, r in enumerate(reqs):
            ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, width - len(r.prompt_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :]

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def finish_reason(self, params: SampleParams, generated: list[int]) -> Optional[str]:
        if not params.ignore_eos and generated[-1] in self.eos_ids:
            return "stop"
        if params.stop and find_stop(self._tail_text(generated, params.stop), params.stop) >= 0:
            return "stop"
        if len(generated) >= params.max_new_tokens:
            return "length"
        return None

    def _tail_text(self, generated: list[int], stops: tuple[str, ...]) -> str:
        """The text of the last tokens only, enough to hold any stop string that ends in the newest token:
        checking the whole generation every step would cost O(length^2) per row. A character takes at
        most 4 tokens (byte-level fallback), and the margin keeps a match clear of the window's first
        token, whose decoding can differ from its decoding in context (a leading space)."""
        window = 4 * max(len(s) for s in stops) + 8
        return self.tokenizer.decode(generated[-window:], skip_special_tokens=True)

    def make_result(self, req: Request, generated: list[int], reason: Optional[str]) -> Result:
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        cut = find_stop(text, req.params.stop) if req.params.stop else -1
        return Result(key=req.key, text=text if cut < 0 else text[:cut], finish_reason=reason or "length",
                      num_prompt_tokens=len(req.prompt_ids), num_generated_tokens=len(generated))


class EngineStats(SchedulerStats):
    """Scheduler counters summed over windows."""

    def add(self, other: SchedulerStats) -> None:
        for name in SchedulerStats.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def pick_tokens(logits: torch.Tensor, params: list[SampleParams], generators: list[Optional[torch.Generator]]
                ) -> list[int]:
    """Next token per row: argmax for greedy rows, a draw from the row's own generator otherwise."""
    tokens = logits.argmax(dim=-1).tolist()  # logits: [B, V]
    for j, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[j] = sample_token(logits[j], p, gen)
    return tokens


def sample_token(logits: torch.Tensor, p: SampleParams, gen: Optional[torch.Generator]) -> int:
    """Temperature, then top-k, then top-p (nucleus), then one multinomial draw. logits: [V]."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())




def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def _model_config(cfg: EngineConfig) -> Any:
    """The checkpoint's config where engine.dtype=auto needs its sizes on CPU; None where it does not load."""
    if cfg.dtype != "auto":
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None


def _model_max_len(config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _first(*values: Optional[int]) -> int:
    return next(v for v in values if v is not None)

