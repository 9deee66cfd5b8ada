"""Throughput of batchgen's hf engine against HF generate, transformers continuous batching and vLLM (CPU).

    python benchmarks/throughput.py            # full: ~100M-param Llama, 64 rows (tables: docs/performance.md)
    python benchmarks/throughput.py --quick    # tiny model, small workload, B1 and E only (the test suite's guard)
    python benchmarks/throughput.py --shape qwen2.5-0.5b --runners B3,E,Eint8 --repeats 2   # a real model's shape
    python benchmarks/throughput.py --device cuda --shape llama-3.2-1b --rows 256 --runners B2,E --sampling

Every runner is its own subprocess; runners are interleaved (B0 B1 B2 B3 E, repeated) and medians
reported. Workload (seeded): prompt lengths log-normal around 100 tokens, capped at 1024; output
lengths uniform in [16, 256] per row through a max_new_tokens column; EOS ignored (as `vllm bench
throughput` does). Useful tokens = the per-row caps, summed. Model load is timed separately (start-up and
warm-up: vLLM's engine start, transformers continuous batching's CUDA graph capture). Greedy by default; with
--sampling every runner samples at temperature 0.8, top_p 0.95, no top-k: E from a seed per row (derived from
--seed and the row's id, as a job does), vLLM from a seed per request, HF generate and transformers continuous
batching from one generator seeded once (they take no per-row seed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgen.engines import prepare_process  # noqa: E402

prepare_process()  # batchgen's OpenMP defaults, before torch loads; every runner inherits them (the same for all)
# Eoff: E with engine.prefix_cache=off; Eint8: E with engine.quantization=int8 (neither run by default)
RUNNERS = ("B0", "B1", "B2", "B3", "E", "Eoff", "Eint8")
E_RUNNERS = ("E", "Eoff", "Eint8", "ENG")  # batchgen's: in E's dtype
DEFAULT_RUNNERS = ("B0", "B1", "B2", "B3", "E")
WORDS = ("the river town market opened closed with many people after rain sun night lamp bread clock train "
         "harbour music quiet loud green blue small large old new fast slow city field stone road").split()


# -- setup (parent process) -----------------------------------------------------------------------

def build(workdir: Path, *, size: str, rows: int, seed: int) -> tuple[Path, Path]:
    """The benchmark model and the workload Parquet (prompts + per-row max_new_tokens), cached in workdir."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from batchgen.engines.toymodel import build_model

    model = workdir / f"model-{size}"  # the same directory as benchmarks/quantization.py's for a real shape
    if not (model / "config.json").exists():
        rng = random.Random(seed)
        texts = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(200)]
        build_model(model, texts, size=size, max_position_embeddings=2048)
    data = workdir / f"workload-{size}-{rows}-{seed}.parquet"
    if not data.exists():
        tok = AutoTokenizer.from_pretrained(model)
        rng = random.Random(seed)
        prompts, caps = [], []
        for _ in range(rows):
            target = min(1024, max(4, int(rng.lognormvariate(4.6, 0.6))))  # median e^4.6 ~ 100 tokens
            words = [rng.choice(WORDS) for _ in range(target)]
            while len(tok(" ".join(words)).input_ids) > target:
                words.pop()
            prompts.append(" ".join(words))
            caps.append(rng.randint(16, 256))
        pq.write_table(pa.table({"prompt": prompts, "max_new_tokens": caps}), data)
    return model, data


DEVICE = os.environ.get("BATCHGEN_BENCH_DEVICE", "cpu")  # --device, handed to every runner's process
SAMPLING = {"temperature": 0.8, "top_p": 0.95}  # --sampling's settings, for every runner (no top-k)
SAMPLE_SEED: Optional[int] = None  # --sampling: the run's seed (--seed); None: greedy. Set in each runner's process


def sync() -> None:
    if DEVICE.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def hf_sampling() -> dict:
    """HF generate's and transformers continuous batching's decoding arguments: greedy, or --sampling's (one
    generator for the run, seeded once: they take no per-row seed)."""
    if SAMPLE_SEED is None:
        return {"do_sample": False}
    import torch

    torch.manual_seed(SAMPLE_SEED)
    return {"do_sample": True, "top_k": 0, **SAMPLING}


def sampling_text() -> str:
    return ", ".join(f"{key} {value}" for key, value in SAMPLING.items())


def job_sampling() -> list[str]:
    """A batchgen job's overrides: none for greedy (the default sampling config), or --sampling's; each row samples
    from its own seed, derived from the job's (sampling.seed) and the row's id."""
    if SAMPLE_SEED is None:
        return []
    return [f"sampling.{key}={value}" for key, value in SAMPLING.items()] + [f"sampling.seed={SAMPLE_SEED}"]


def calibrate(dtype_name: str) -> dict:
    """GEMM FLOP/s in the engine's dtype and read bandwidth, measured now, on this machine (on --device)."""
    import torch

    dtype = getattr(torch, dtype_name)
    n = 1024 if DEVICE == "cpu" else 8192
    a, b = torch.randn(n, n, dtype=dtype, device=DEVICE), torch.randn(n, n, dtype=dtype, device=DEVICE)
    a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    flops = 10 * 2 * n**3 / (time.perf_counter() - t)
    big = torch.ones(128 * 1024 * 1024 // 4, dtype=torch.float32, device=DEVICE)  # 512 MiB
    big.sum()
    sync()
    t = time.perf_counter()
    for _ in range(5):
        big.sum()
    sync()
    bandwidth = 5 * big.numel() * 4 / (time.perf_counter() - t)
    return {"gemm_flops": flops, "read_bytes_per_s": bandwidth}


# -- runners (child processes) --------------------------------------------------------------------

def load_workload(data: Path, model: Path) -> tuple[list[list[int]], list[int]]:
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    table = pq.read_table(data)
    tok = AutoTokenizer.from_pretrained(model)
    return tok(table.column("prompt").to_pylist()).input_ids, table.column("max_new_tokens").to_pylist()


def load_hf(model: Path, dtype: str, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), **kwargs).to(DEVICE).eval()
    m.generation_config.eos_token_id = None  # ignore EOS: every row runs to its cap
    sync()
    return m, time.perf_counter() - t


def run_b0(model: Path, data: Path, dtype: str, subset: int) -> dict:
    """HF generate, one row at a time (on the first `subset` rows: the rate is what compares)."""
    import torch

    ids, caps = load_workload(data, model)
    m, load_s = load_hf(model, dtype)
    decoding = hf_sampling()
    useful = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for p, cap in list(zip(ids, caps))[:subset]:
            m.generate(torch.tensor([p], device=DEVICE), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                       device=DEVICE), max_new_tokens=cap, min_new_tokens=cap, **decoding)
            useful += cap
    sync()
    return {"useful_tokens": useful, "gen_s": time.perf_counter() - t, "load_s": load_s, "row_steps": useful}


def run_b1(model: Path, data: Path, dtype: str, batch: int = 16) -> dict:
    """HF generate, fixed batches of 16 in input order (left-padded, each batch runs to its longest cap)."""
    import torch

    ids, caps = load_workload(data, model)
    m, load_s = load_hf(model, dtype)
    pad = m.config.pad_token_id or 0
    decoding = hf_sampling()
    row_steps = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            chunk, chunk_caps = ids[start:start + batch], caps[start:start + batch]
            width = max(len(p) for p in chunk)
            x = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=DEVICE)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=DEVICE)
            m.generate(x, attention_mask=mask, max_new_tokens=max(chunk_caps), min_new_tokens=max(chunk_caps),
                       pad_token_id=pad, **decoding)
            row_steps += len(chunk) * max(chunk_caps)
    sync()
    return {"useful_tokens": sum(caps), "gen_s": time.perf_counter() - t, "load_s": load_s, "row_steps": row_steps}


def cb_config():
    """B2's ContinuousBatchingConfig. On CPU: batches of 512 tokens and pages of 64 tokens (tuned there; the field is
    `page_size` from transformers 5.25, `block_size` before, so it is looked up). On CUDA: transformers' own GPU
    defaults (the cache sized from free memory, CUDA graphs and async batching as it decides). Seeded (--sampling)
    where it takes a seed."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    kwargs = {"seed": SAMPLE_SEED} if SAMPLE_SEED is not None and "seed" in fields else {}
    if not DEVICE.startswith("cuda"):
        page = next(name for name in ("page_size", "block_size") if name in fields)
        kwargs |= {"max_batch_tokens": 512, page: 64}
    return ContinuousBatchingConfig(**kwargs)


def cb_hints(m, ids: list[list[int]], caps: list[int]) -> dict:
    """On CUDA, the workload's shape for transformers to size its cache and graphs by, as its generate_batch does
    (where the context manager takes it); nothing on CPU, whose figures were measured without."""
    import inspect

    if not DEVICE.startswith("cuda") or "workload_hints" not in inspect.signature(
            m.continuous_batching_context_manager).parameters:
        return {}
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return {"workload_hints": WorkloadHints(max_prompt_length=max(map(len, ids)), max_generated_length=max(caps),
                                            num_requests=len(ids))}


def run_b2(model: Path, data: Path, dtype: str) -> dict:
    """transformers continuous batching (paged attention), per-row max_new_tokens. Entering its context manager
    warms it up (on CUDA: the cache's allocation and the CUDA graphs' capture): that counts as load, not generation,
    as vLLM's start-up does in B3."""
    from transformers import GenerationConfig

    ids, caps = load_workload(data, model)
    m, load_s = load_hf(model, dtype, attn_implementation="paged|sdpa")
    gen_cfg = GenerationConfig(max_new_tokens=max(caps), eos_token_id=None, **hf_sampling())
    t = time.perf_counter()
    with m.continuous_batching_context_manager(generation_config=gen_cfg, continuous_batching_config=cb_config(),
                                               block=True, timeout=5, **cb_hints(m, ids, caps)) as manager:
        load_s += time.perf_counter() - t
        t = time.perf_counter()
        for i, (p, cap) in enumerate(zip(ids, caps)):
            manager.add_request(p, request_id=str(i), max_new_tokens=cap)
        done = 0
        while done < len(ids):
            result = manager.get_result(timeout=5)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing")
                continue
            done += result.is_finished()
        gen_s = time.perf_counter() - t
    return {"useful_tokens": sum(caps), "gen_s": gen_s, "load_s": load_s, "row_steps": sum(caps)}


def run_b3(model: Path, data: Path, dtype: str) -> dict:
    """vLLM (CPU build), offline LLM.generate on token ids, per-row max_tokens, ignore_eos."""
    from vllm import LLM, SamplingParams

    ids, caps = load_workload(data, model)
    t = time.perf_counter()
    llm = LLM(model=str(model), dtype=dtype, max_model_len=2048, seed=0)
    load_s = time.perf_counter() - t
    decoding = [{"temperature": 0.0}] * len(caps) if SAMPLE_SEED is None else [
        SAMPLING | {"seed": SAMPLE_SEED * 1_000_003 + i} for i in range(len(caps))]  # a seed per request
    params = [SamplingParams(max_tokens=c, ignore_eos=True, **d) for c, d in zip(caps, decoding)]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    gen_s = time.perf_counter() - t
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"useful_tokens": useful, "gen_s": gen_s, "load_s": load_s, "row_steps": useful}


def run_engine(model: Path, data: Path, dtype: str) -> dict:
    """batchgen's hf engine alone (no reader, no committer): the baseline for job overhead."""
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    ids, caps = load_workload(data, model)
    t = time.perf_counter()
    engine = HFEngine(HFConfig(model=str(model), dtype=dtype, device=DEVICE), AutoTokenizer.from_pretrained(model))
    load_s = time.perf_counter() - t
    decoding = {"temperature": 0.0, "top_p": 1.0} if SAMPLE_SEED is None else SAMPLING
    reqs = [Request(key=i, prompt_ids=p, seed=None if SAMPLE_SEED is None else SAMPLE_SEED * 1_000_003 + i,
                    params=SampleParams(max_new_tokens=c, top_k=0, stop=(), ignore_eos=True, **decoding))
            for i, (p, c) in enumerate(zip(ids, caps))]  # a seed per row (sampling)
    t = time.perf_counter()
    results = engine.generate(reqs)
    gen_s = time.perf_counter() - t
    s = engine.stats().counters
    return {"useful_tokens": sum(r.num_generated_tokens for r in results), "gen_s": gen_s, "load_s": load_s,
            "row_steps": s["decode_row_steps"] + s["prefill_rows"], "prefill_tokens": s["prefill_tokens"]}


def run_e(model: Path, data: Path, dtype: str, out: Path, rows: int, *extra: str) -> dict:
    """A real batchgen job: Parquet in, Parquet out, through the CLI."""
    return run_job(model, data, dtype, out, rows, *extra)[0]


def run_job(model: Path, data: Path, dtype: str, out: Path, rows: int, *extra: str,
            env: Optional[dict[str, str]] = None) -> tuple[dict, str]:
    """run_e's job in `env` (default this process's): its figures, and its log (stdout and stderr)."""
    import shutil

    import pyarrow.dataset as ds

    shutil.rmtree(out, ignore_errors=True)
    args = [sys.executable, "-m", "batchgen", "name=bench", f"output_dir={out}", f"dataset.path={data}",
            "dataset.max_new_tokens_column=max_new_tokens", "sampling.max_new_tokens=256", "sampling.ignore_eos=true",
            f"engine.model={model}", f"engine.dtype={dtype}", f"run.rows_per_part={rows}", "run.progress=false",
            f"engine.device={DEVICE}", *job_sampling(), *extra]
    t = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    line = next(x for x in proc.stdout.splitlines() if "this run:" in x)
    job_s = float(line.split(" in ")[1].split("s")[0])  # the job's own wall time, model load included
    load_s = float(line.split("model load ")[1].split("s")[0])  # start-up: imports, tokenizer, checks, model
    useful = sum(ds.dataset(str(out)).to_table(columns=["num_generated_tokens"]).column(0).to_pylist())
    return ({"useful_tokens": useful, "gen_s": job_s - load_s, "load_s": load_s, "process_s": wall},
            proc.stdout + proc.stderr)


def child(args: argparse.Namespace) -> None:
    global SAMPLE_SEED
    SAMPLE_SEED = args.seed if args.sampling else None
    model, data, dtype = Path(args.model), Path(args.data), args.dtype
    runner = {"B0": lambda: run_b0(model, data, dtype, args.b0_rows), "B1": lambda: run_b1(model, data, dtype),
              "B2": lambda: run_b2(model, data, dtype), "B3": lambda: run_b3(model, data, dtype),
              "ENG": lambda: run_engine(model, data, dtype),
              "E": lambda: run_e(model, data, dtype, Path(args.workdir) / "e-out", args.rows),
              "Eoff": lambda: run_e(model, data, dtype, Path(args.workdir) / "e-out", args.rows,
                                    "engine.prefix_cache=off"),
              "Eint8": lambda: run_e(model, data, dtype, Path(args.workdir) / "e-out", args.rows,
                                     "engine.quantization=int8")}[args.run]
    sampler = TreeRSS()
    result = runner()
    result["peak_rss"] = sampler.stop()
    print("RESULT " + json.dumps(result))


class TreeRSS:
    """The peak of the summed resident size of this process and all its descendants (E's job process; vLLM's engine
    core and worker processes), sampled every 0.2 s from /proc in a thread."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.sample())

    @staticmethod
    def sample() -> int:
        from batchgen.run.stopping import descendants, process_table

        table = process_table()
        tree = descendants({os.getpid()}, table)
        return sum(table[pid][2] for pid in tree if pid in table) * os.sysconf("SC_PAGE_SIZE")

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.sample())


# -- orchestration --------------------------------------------------------------------------------

def spawn(name: str, args: argparse.Namespace, model: Path, data: Path, python: str,
          dtype: Optional[str] = None) -> dict:
    dtype = dtype or (args.dtype if name in E_RUNNERS else args.baseline_dtype)
    cmd = [python, __file__, "--run", name, "--model", str(model), "--data", str(data), "--dtype", dtype,
           "--workdir", str(args.workdir), "--rows", str(args.rows), "--b0-rows", str(args.b0_rows), "--seed",
           str(args.seed)] + (["--sampling"] if args.sampling else [])
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2",
                        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        errors = [x for x in lines if "Error" in x or "error" in x] or lines or [f"exit {proc.returncode}"]
        return {"error": errors[-1].strip()[-200:]}
    return json.loads(line[len("RESULT "):])


def summarize(samples: list[dict]) -> dict:
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return {"error": samples[0]["error"]}
    out = {k: statistics.median(s[k] for s in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))}
    out["tok_s"] = statistics.median(s["useful_tokens"] / s["gen_s"] for s in ok)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 128 rows, B1 and E only")
    parser.add_argument("--rows", type=int, default=None, help="default 64 (--quick: 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runners", default=None, help=f"comma-separated subset of {','.join(RUNNERS)}")
    parser.add_argument("--b0-rows", type=int, default=8, help="B0 runs on the first rows only (its rate compares)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--dtype", default=None, help="E's dtype; default: what engine.dtype=auto picks here for the "
                                                      "benchmark model")
    parser.add_argument("--baseline-dtype", default=None,
                        help="B0-B3's dtype, or 'best': each in float32 and bfloat16 and the faster kept (the quick "
                             "mode's default); default otherwise: the dtype the engine's calibration measured faster "
                             "for the model's GEMMs on this CPU")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--seed", type=int, default=0, help="the workload's, and with --sampling the samples'")
    parser.add_argument("--sampling", action="store_true",
                        help=f"sample ({sampling_text()}; E: a seed per row) instead of greedy decoding")
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument("--no-engine-alone", action="store_true", help="skip ENG, the engine alone (the job overhead "
                        "and roofline lines; run by default outside --quick): one model load less")
    parser.add_argument("--device", default=None, help="cpu (default) or cuda: every runner on that device (B3, "
                                                       "vLLM's CPU build, is CPU only)")
    parser.add_argument("--shape", default=None, help="the model: bench (default; --quick: tiny), or a real model's "
                        "shape, qwen2.5-0.5b or llama-3.2-1b (random weights, the real vocabulary size; built once)")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        child(args)
        return
    if args.device:
        global DEVICE
        DEVICE = os.environ["BATCHGEN_BENCH_DEVICE"] = args.device  # the runners' processes inherit it
    # quick: enough rows that the job's fixed costs (start-up after load, commit) stay small beside its generation
    # on a fast CPU (48 rows took E 0.5 s on the Zen 5 EPYC)
    args.rows = args.rows or (128 if args.quick else 64)
    if args.quick:
        args.repeats = 2
        args.runners = args.runners or "B1,E"
    args.runners = args.runners or ",".join(DEFAULT_RUNNERS)
    size = args.shape or ("tiny" if args.quick else "bench")
    args.workdir.mkdir(parents=True, exist_ok=True)
    model, data = build(args.workdir, size=size, rows=args.rows, seed=args.seed)
    auto = auto_dtype(model)
    args.dtype = args.dtype or auto
    args.baseline_dtype = args.baseline_dtype or ("best" if args.quick else auto)
    report(args, model, data, size)


def auto_dtype(model: Path) -> str:
    """What engine.dtype=auto picks on this CPU for the model (measured by the engine's calibration)."""
    import torch
    from transformers import AutoConfig

    from batchgen.engines.hf.device import resolve_dtype

    return str(resolve_dtype("auto", torch.device(DEVICE), AutoConfig.from_pretrained(model))).removeprefix("torch.")


def report(args: argparse.Namespace, model: Path, data: Path, size: str) -> None:
    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    runners = [r for r in args.runners.split(",") if r]
    calib = calibrate(args.dtype)  # E's dtype: the roofline line is E's
    has_vllm = Path(args.vllm_python).exists()
    extra = [] if args.quick or args.no_engine_alone else ["ENG"]  # the engine alone: job overhead, efficiency
    # --baseline-dtype best: each baseline in float32 and in bfloat16, interleaved, and the faster median kept
    tried = ("float32", "bfloat16") if args.baseline_dtype == "best" else (args.baseline_dtype,)
    runs = [(name, dtype) for name in runners + extra
            for dtype in ((args.dtype,) if name in E_RUNNERS else tried)]
    samples: dict[tuple[str, str], list[dict]] = {run: [] for run in runs}
    for _ in range(args.repeats):
        for name, dtype in runs:
            if name == "B3" and not has_vllm:
                venv = Path(args.vllm_python).parent.parent.name
                samples[name, dtype].append({"error": f"no vLLM environment at {venv}/ (make vllm-venv)"})
                continue
            python = args.vllm_python if name == "B3" else sys.executable
            samples[name, dtype].append(spawn(name, args, model, data, python, dtype))
            print(f"  {name} ({dtype}): {samples[name, dtype][-1]}", file=sys.stderr, flush=True)
    med: dict[str, dict] = {}
    for (name, dtype), runs_of_it in samples.items():
        m = summarize(runs_of_it) | {"dtype": dtype}
        if name not in med or m.get("tok_s", 0) > med[name].get("tok_s", 0):
            med[name] = m
    print_table(args, med, calib, model, size)
    if args.json:
        out = {"medians": med, "calibration": calib, "cpu": describe_cpu(), "dtype": args.dtype,
               "baseline_dtype": args.baseline_dtype, "sampling": SAMPLING if args.sampling else None,
               "device": DEVICE, "rows": args.rows}
        args.json.write_text(json.dumps(out, indent=2))


def print_table(args: argparse.Namespace, med: dict, calib: dict, model: Path, size: str) -> None:
    import json as _json

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    cfg = _json.loads((model / "config.json").read_text())
    params = _count_params(cfg)
    print(f"\n{describe_cpu()}")
    print("openmp (every runner): " + ", ".join(f"{k}={os.environ.get(k, 'unset')}"
                                                 for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")))
    if DEVICE != "cpu":
        import torch

        print(f"device: {DEVICE} ({torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA "
              f"{torch.version.cuda})")
    decoding = f"sampling {sampling_text()}" if args.sampling else "greedy"
    print(f"model: random-weight Llama '{size}' ({params / 1e6:.0f}M params), E in {args.dtype}, baselines in "
          f"{args.baseline_dtype}, {args.rows} rows, {decoding}, {args.repeats} repeats (medians)")
    print(f"calibration: GEMM {calib['gemm_flops'] / 1e9:.0f} GFLOP/s ({args.dtype}), read bandwidth "
          f"{calib['read_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"{'run':<5} {'useful tok/s':>12} {'E/run':>7} {'efficiency':>10} {'load s':>7} {'dtype':>9} "
          f"{'peak RSS MB':>11}")
    e = med.get("E", {})
    for name in [n for n in RUNNERS if n in med]:
        m = med[name]
        if "error" in m:
            print(f"{name:<5} {'n/a':>12} {'n/a':>7} {'':>10} {'':>7}  ({m['error']})")
            continue
        ratio = e["tok_s"] / m["tok_s"] if "tok_s" in e else float("nan")
        ref = m if "row_steps" in m else med.get("ENG", {})
        eff = f"{100 * ref['useful_tokens'] / ref['row_steps']:>9.1f}%" if "row_steps" in ref else f"{'':>10}"
        rss = f"{m['peak_rss'] / 1e6:>11.0f}" if "peak_rss" in m else f"{'':>11}"
        print(f"{name:<5} {m['tok_s']:>12.1f} {ratio:>7.2f} {eff} {m['load_s']:>7.1f} {m['dtype']:>9} {rss}")
    quantized = med.get("Eint8", {})
    if "tok_s" in quantized:
        against = {n: quantized["tok_s"] / med[n]["tok_s"] for n in ("E", "B3") if "tok_s" in med.get(n, {})}
        print("Eint8 (engine.quantization=int8): " + ", ".join(f"{v:.2f}x {n}" for n, v in against.items()))
    if "tok_s" in e and "tok_s" in med.get("ENG", {}):
        eng = med["ENG"]
        overhead = e["gen_s"] / eng["gen_s"] - 1
        print(f"job overhead: job {e['gen_s']:.1f}s vs engine alone {eng['gen_s']:.1f}s (model load excluded): "
              f"{100 * overhead:+.1f}%")
        flops = 2 * params * (eng["prefill_tokens"] + eng["useful_tokens"]) / eng["gen_s"]
        print(f"roofline: E computes {flops / 1e9:.1f} GFLOP/s of weight matmuls = "
              f"{100 * flops / calib['gemm_flops']:.0f}% of measured GEMM peak")


def _count_params(cfg: dict) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    return L * (2 * h * h + 2 * h * kv + 3 * h * i) + 2 * v * h


if __name__ == "__main__":
    main()
