"""Weight quantization in batchgen's hf engine: memory, speed and fidelity against the unquantized model.

    python benchmarks/quantization.py            # full: 76M-param Llama, none / bf16 / int8 / int4, 3 repeats
    python benchmarks/quantization.py --quick    # tiny model, none and int8, one repeat (the test suite's guard)
    python benchmarks/quantization.py --repeats 1 --json q.json --append   # one repeat more, added to q.json
    python benchmarks/quantization.py --shape qwen2.5-0.5b --configs none,int8,int8_wo,int4   # a real model's shape

Every configuration runs in its own subprocess (so peak RSS is its own); configurations are
interleaved (none bf16 int8 int4, repeated) and speed ratios are medians of same-repeat ratios, to
`none` (the unquantized model in the dtype `engine.dtype=auto` picks on this machine: float32 on a
CPU without fast bf16) and to `bf16` (the unquantized model in bfloat16). Weight bytes are also given
against a bf16 copy of the model (2 bytes per parameter). Speed is end-to-end output tokens/s of
HFEngine.generate (prefill included): batch 1 (engine.max_batch_size=1) and the engine's working
batch size (its default, all rows at once), the latter twice: a full run and a short one with few
decode steps. bf16 runs only the short one at the working batch (on a CPU without fast bf16 its
GEMMs are emulated), so the ratios to bf16 at the working batch are those of the short run, which
every configuration runs. EOS is ignored so every row runs to its cap. `--append` adds the new
repeats to the samples already in `--json` (same configurations), so that a long measurement can be
taken in several shorter commands.

Fidelity, against `none` (float32 here: a stricter reference than bf16, which is itself rounded), on
seeded random token ids (the model has random weights): teacher-forced top-1 next-token agreement
and mean KL(none || scheme) per position, with all positions in one forward (the prefill path);
for int8 and int4 also through the small-batch decode kernel (`int8 decode path`: batchgen's AVX2
kernel where it is built, else aten's; `int4 decode path`: batchgen's kernel); greedy agreement: share
of rows whose greedy generation is identical, and the mean position of the first differing token over
the rows that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from batchgen.engines import prepare_process  # noqa: E402

prepare_process()  # batchgen's OpenMP defaults, before torch loads
CONFIGS = {  # name: (engine.quantization, engine.dtype)
    "none": (None, "auto"),
    "float32": (None, "float32"),  # where 'none' is bf16: the fidelity reference (it is then against float32)
    "bf16": (None, "bfloat16"),
    "int8": ("int8", "auto"),
    "int8_wo": ("int8_wo", "auto"),
    "int4": ("int4", "auto"),
}
FULL = dict(size="bench", configs=("none", "bf16", "int8", "int4"), repeats=3, fidelity=(8, 128),
            greedy=(16, 16, 32), b1=(4, 16, 64), working=(64, 16, 16), short=(64, 16, 4))
QUICK = dict(size="tiny", configs=("none", "int8"), repeats=1, fidelity=(2, 32), greedy=(4, 8, 8),
             b1=(2, 8, 8), working=(8, 8, 8), short=(8, 8, 2))
# b1, working, short, greedy: (rows, prompt tokens, new tokens); fidelity: (rows, tokens). At a real model's shape
# (--shape) fewer fidelity rows: the saved log-probabilities are rows x tokens x 152k floats.
REAL_FIDELITY = (4, 128)
# "short" is the working batch with few decode steps: bf16 runs only that one at the working batch (its GEMMs are
# emulated on a CPU without fast bf16 and a full run takes minutes), and every configuration runs it too, so that
# the ratios to bf16 at the working batch compare the same workload.
SLOW_AT_WORKING_BATCH = {"bf16"}


# -- child: one configuration ---------------------------------------------------------------------

def token_rows(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (rows, length), generator=gen).tolist()  # above the special tokens


def load_engine(model: Path, config: str):
    from transformers import AutoTokenizer

    from batchgen.engines.hf.config import HFConfig
    from batchgen.engines.hf.engine import HFEngine
    from batchgen.engines.hf.sampling.sampler import Sampler

    scheme, dtype = CONFIGS[config]
    tok = AutoTokenizer.from_pretrained(model)

    class RecordingSampler(Sampler):  # keeps each result's token ids for the greedy comparison
        ids: dict[int, list[int]] = {}

        def make_result(self, req, generated, reason, draw=None):
            self.ids[req.key] = list(generated)
            return super().make_result(req, generated, reason, draw)

    engine = HFEngine(HFConfig(model=str(model), quantization=scheme, dtype=dtype, device="cpu"), tok)
    engine.sampler = RecordingSampler(tok, engine.eos_ids, engine.device)
    engine.ids = engine.sampler.ids
    return engine


def requests(rows: list[list[int]], new_tokens: int):
    from batchgen.records import Request
    from batchgen.sampling import SampleParams

    params = SampleParams(max_new_tokens=new_tokens, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=True)
    return [Request(key=i, prompt_ids=r, params=params, seed=None) for i, r in enumerate(rows)]


def timed_generate(engine, rows: list[list[int]], new_tokens: int, batch: int) -> float:
    """Output tokens/s of one generate call with at most `batch` rows decoded together."""
    engine.max_batch_size = batch
    start = time.perf_counter()
    results = engine.generate(requests(rows, new_tokens))
    return sum(r.num_generated_tokens for r in results) / (time.perf_counter() - start)


def plan_for(args: argparse.Namespace) -> dict:
    plan = dict(QUICK if args.quick else FULL)
    if args.shape:
        plan["size"] = args.shape
        if args.shape != "bench":
            plan["fidelity"] = REAL_FIDELITY
    return plan


def child(args: argparse.Namespace) -> None:
    import torch

    from batchgen.engines.hf import quant

    plan = plan_for(args)
    engine = load_engine(args.model, args.run)
    vocab = engine.model.config.vocab_size
    out = {"config": args.run, "dtype": str(engine.dtype).removeprefix("torch."),
           "weight_bytes": quant.weight_bytes(engine.model), "params": args.params,
           "rss_after_load": _rss_now()}
    working = engine.max_batch_size
    if args.fidelity:
        n, length = plan["fidelity"]
        with torch.inference_mode():
            ids = torch.tensor(token_rows(n, length, vocab, seed=1))
            logits = engine.model(input_ids=ids).logits.float()  # [n, T, V]
        torch.save(torch.log_softmax(logits, dim=-1), args.workdir / f"logprobs-{args.run}.pt")
        decode = args.workdir / f"logprobs-{args.run}-decode.pt"
        decode.unlink(missing_ok=True)
        # every linear through the small-batch kernel
        if quant.route_rows(engine.model, n * length + 1, n * length + 1):
            with torch.inference_mode():
                logits = engine.model(input_ids=ids).logits.float()
            quant.route_rows(engine.model)  # back to the engine's routes
            torch.save(torch.log_softmax(logits, dim=-1), decode)
        rows, prompt, new = plan["greedy"]
        engine.generate(requests(token_rows(rows, prompt, vocab, seed=2), new))
        out["greedy"] = [engine.ids[i] for i in range(rows)]
    for name in ("b1", "working", "short"):
        if name == "working" and args.run in SLOW_AT_WORKING_BATCH:
            continue
        rows, prompt, new = plan[name]
        out[f"tok_s_{name}"] = timed_generate(engine, token_rows(rows, prompt, vocab, seed=3), new,
                                              1 if name == "b1" else working)
    out["working_batch"] = working
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- parent: build, interleave, compare ---------------------------------------------------------

def build(workdir: Path, size: str) -> Path:
    import random

    from batchgen.engines.toymodel import build_model

    model = workdir / f"model-{size}"
    if not (model / "config.json").exists():
        rng = random.Random(0)
        words = "the river town market opened closed with many people after rain sun night lamp bread".split()
        build_model(model, [" ".join(rng.choice(words) for _ in range(200)) for _ in range(200)], size=size)
    return model


def spawn(args: argparse.Namespace, model: Path, config: str, *, fidelity: bool, params: int) -> dict:
    cmd = [sys.executable, __file__, "--run", config, "--model", str(model), "--workdir", str(args.workdir),
           "--params", str(params)] + (["--quick"] if args.quick else []) + (["--fidelity"] if fidelity else [])
    cmd += ["--shape", args.shape] if args.shape else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fidelity(workdir: Path, config: str, ref_greedy: list[list[int]], greedy: list[list[int]],
             reference: str = "none") -> dict:
    ref = load_logprobs(workdir, reference)  # [n, T, V] log-probs
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(ref_greedy, greedy)]
    differing = [f for f in firsts if f is not None]
    out = {**agreement(ref, load_logprobs(workdir, config)), "greedy_identical": firsts.count(None) / len(firsts),
           "first_divergence": statistics.mean(differing) if differing else None}
    decode = load_logprobs(workdir, f"{config}-decode")
    if decode is not None:
        out["decode_path"] = agreement(ref, decode)
    return out


def load_logprobs(workdir: Path, name: str):
    import torch

    path = workdir / f"logprobs-{name}.pt"
    return torch.load(path) if path.exists() else None


def agreement(ref, cur) -> dict:
    return {"top1": (ref.argmax(-1) == cur.argmax(-1)).float().mean().item(),
            "kl": (ref.exp() * (ref - cur)).sum(-1).mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, help="0 with --append: print the table of the samples in --json")
    parser.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--shape", default=None, help="the model's shape: bench (default), or a real model's, "
                        "qwen2.5-0.5b or llama-3.2-1b (random weights, the real vocabulary size; built once)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--append", action="store_true", help="add the new repeats to the samples in --json")
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fidelity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return child(args)
    plan = plan_for(args)
    configs = args.configs.split(",") if args.configs else list(plan["configs"])
    configs = ["none"] + [c for c in configs if c != "none"]
    samples: dict[str, list[dict]] = {c: [] for c in configs}
    if args.append:
        if args.json is None:
            parser.error("--append needs --json")
        if args.json.exists():
            samples = json.loads(args.json.read_text())["samples"]
            if set(samples) != set(configs):
                parser.error(f"--append: {args.json} holds {', '.join(samples)}, not {', '.join(configs)}")
            samples = {c: samples[c] for c in configs}
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build(args.workdir, plan["size"])
    params = _count_params(model)
    first = len(samples["none"])
    for repeat in range(first, first + (plan["repeats"] if args.repeats is None else args.repeats)):
        for config in configs:  # interleaved: none, bf16, int8, int4, none, ...
            samples[config].append(spawn(args, model, config, fidelity=repeat == 0, params=params))
            print(f"repeat {repeat} {config}: " + ", ".join(f"{k} {v:.1f}" for k, v in samples[config][-1].items()
                                                           if k.startswith("tok_s")), file=sys.stderr)
        if args.json:  # after each repeat, so that an interrupted run keeps what it measured
            args.json.write_text(json.dumps({"rows": None, "samples": samples}, indent=1))
    table = summarize(args.workdir, samples, params)
    print_table(table, plan, params, len(samples["none"]))
    if args.json:
        from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

        args.json.write_text(json.dumps({"rows": table, "samples": samples, "cpu": describe_cpu()}, indent=1))


SPEEDS = ("b1", "working", "short")


def summarize(workdir: Path, samples: dict[str, list[dict]], params: int) -> list[dict]:
    rows = []
    for config, runs in samples.items():
        first = runs[0]
        row = {"config": config, "dtype": first["dtype"], "weight_mb": first["weight_bytes"] / 1e6,
               "vs_bf16": first["weight_bytes"] / (2 * params),
               "vs_none": first["weight_bytes"] / samples["none"][0]["weight_bytes"],
               "peak_rss_mb": max(r["peak_rss"] for r in runs) / 1e6,
               "rss_after_load_mb": statistics.median(r["rss_after_load"] for r in runs) / 1e6,
               "working_batch": first["working_batch"]}
        for name in SPEEDS:
            row[f"tok_s_{name}"] = median_of(r.get(f"tok_s_{name}") for r in runs)
            for base in ("none", "bf16"):  # same-repeat ratios
                ratios = [r.get(f"tok_s_{name}") / b[f"tok_s_{name}"] if r.get(f"tok_s_{name}") and
                          b.get(f"tok_s_{name}") else None for r, b in zip(runs, samples.get(base, []))]
                row[f"x_{base}_{name}"] = median_of(ratios)
        row["ratio_b1"], row["ratio_working"] = row["x_none_b1"], row["x_none_working"]  # older key names
        reference = fidelity_reference(samples)
        row.update(fidelity(workdir, config, samples[reference][0]["greedy"], first["greedy"], reference))
        rows.append(row)
    return rows


def fidelity_reference(samples: dict) -> str:
    """'float32' where it was run (a stricter reference than a bf16 'none'), else 'none'."""
    return "float32" if "float32" in samples else "none"


def median_of(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def print_table(rows: list[dict], plan: dict, params: int, repeats: int) -> None:
    def num(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def x(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.2f}x"

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu

    base = rows[0]["dtype"]
    batch = rows[0]["working_batch"]
    print(f"\n{describe_cpu()}")
    (r1, p1, n1), (rw, pw, nw), (rs, ps, ns) = plan["b1"], plan["working"], plan["short"]
    print(f"\nmodel: {plan['size']} Llama, {params / 1e6:.1f}M params; {repeats} interleaved repeat(s); ratios are "
          f"medians of same-repeat ratios to 'none' ({base}) and to 'bf16' (unquantized bfloat16)")
    print(f"B=1: {r1} rows x {p1} prompt tokens, {n1} new each, one row at a time; B={batch}: {rw} rows x {pw} "
          f"prompt, {nw} new; B={batch} short: {rs} rows x {ps} prompt, {ns} new (the only B={batch} run of bf16)")
    print("| config | compute dtype | weight MB | vs bf16 | vs none | peak RSS MB | RSS after load MB "
          f"| tok/s B=1 | x none | x bf16 | tok/s B={batch} | x none | tok/s B={batch} short | x none | x bf16 |")
    print("|" + " --- |" * 15)
    for r in rows:
        print(f"| {r['config']} | {r['dtype']} | {r['weight_mb']:.1f} | {r['vs_bf16']:.2f}x | {r['vs_none']:.2f}x "
              f"| {r['peak_rss_mb']:.0f} | {r['rss_after_load_mb']:.0f} "
              f"| {num(r['tok_s_b1'], '.1f')} | {x(r['x_none_b1'])} | {x(r['x_bf16_b1'])} "
              f"| {num(r['tok_s_working'], '.1f')} | {x(r['x_none_working'])} "
              f"| {num(r['tok_s_short'], '.1f')} | {x(r['x_none_short'])} | {x(r['x_bf16_short'])} |")
    (n, length), (gr, gp, gn) = plan["fidelity"], plan["greedy"]
    reference = "float32" if any(r["config"] == "float32" for r in rows) else "none"
    print(f"\nfidelity against '{reference}' ({'float32' if reference == 'float32' else base}): teacher forcing on "
          f"{n} x {length} seeded token ids in one forward; "
          f"greedy generation of {gr} rows x {gp} prompt tokens, {gn} new")
    print("| config | top-1 | mean KL | greedy identical | first divergence |")
    print("|" + " --- |" * 5)
    for r in rows:
        print(f"| {r['config']} | {r['top1']:.1%} | {r['kl']:.5f} | {r['greedy_identical']:.0%} "
              f"| {num(r['first_divergence'], '.1f')} |")
        if "decode_path" in r:
            d = r["decode_path"]
            print(f"| {r['config']} decode path | {d['top1']:.1%} | {d['kl']:.5f} | | |")


def _count_params(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                total += _prod(f.get_slice(key).get_shape())
    return total


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


if __name__ == "__main__":
    main()
