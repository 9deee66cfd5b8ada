"""Weight quantization in batchgen's hf engine: memory, speed and fidelity against the unquantized model.

    python benchmarks/quantization.py            # full: ~90M-param Llama, none / int8 / int4, 3 repeats
    python benchmarks/quantization.py --quick    # tiny model, none and int8, one repeat (the test suite's guard)

Every configuration runs in its own subprocess (so peak RSS is its own); configurations are
interleaved (none int8 int4, repeated) and speed ratios are medians of same-repeat ratios to
`none`, the unquantized model in the dtype `engine.dtype=auto` picks on this machine (float32 on a
CPU without fast bf16). Weight bytes are also given against a bf16 copy of the model (2 bytes per
parameter). Speed is end-to-end output tokens/s of HFEngine.generate (prefill included): batch 1
(engine.max_batch_size=1) and the engine's working batch size (its default, all rows at once). EOS is
ignored so every row runs to its cap. Fidelity, on seeded random token ids (the model has random
weights): teacher-forced top-1 next-token agreement and mean KL(none || scheme) per position;
greedy agreement: share of rows whose greedy generation is identical, and the mean position of the
first differing token over the rows that differ.
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CONFIGS = {  # name: (engine.quantization, engine.dtype)
    "none": (None, "auto"),
    "bf16": (None, "bfloat16"),
    "int8": ("int8", "auto"),
    "int4": ("int4", "auto"),
}
FULL = dict(size="bench", configs=("none", "int8", "int4"), repeats=3, fidelity=(8, 128), greedy=(16, 16, 32),
            b1=(2, 16, 32), working=(64, 16, 16))  # bf16 only with --configs: emulated bf16 GEMMs take minutes here
QUICK = dict(size="tiny", configs=("none", "int8"), repeats=1, fidelity=(2, 32), greedy=(4, 8, 8),
             b1=(2, 8, 8), working=(8, 8, 8))  # (rows, prompt tokens, new tokens); fidelity: (rows, tokens)


# -- child: one configuration ---------------------------------------------------------------------

def token_rows(rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (rows, length), generator=gen).tolist()  # above the special tokens


def load_engine(model: Path, config: str):
    from transformers import AutoTokenizer

    from batchgen.engines.base import EngineConfig
    from batchgen.engines.hf import HFEngine

    scheme, dtype = CONFIGS[config]
    tok = AutoTokenizer.from_pretrained(model)

    class RecordingEngine(HFEngine):  # keeps each result's token ids for the greedy comparison
        ids: dict[int, list[int]] = {}

        def make_result(self, req, generated, reason):
            self.ids[req.key] = list(generated)
            return super().make_result(req, generated, reason)

    return RecordingEngine(EngineConfig(model=str(model), quantization=scheme, dtype=dtype, device="cpu"), tok)


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


def child(args: argparse.Namespace) -> None:
    import torch

    from batchgen.engines.quant import weight_bytes

    plan = QUICK if args.quick else FULL
    engine = load_engine(args.model, args.run)
    vocab = engine.model.config.vocab_size
    out = {"config": args.run, "dtype": str(engine.dtype).removeprefix("torch."),
           "weight_bytes": weight_bytes(engine.model), "params": args.params,
           "rss_after_load": _rss_now()}
    working = engine.max_batch_size
    if args.fidelity:
        n, length = plan["fidelity"]
        with torch.inference_mode():
            ids = torch.tensor(token_rows(n, length, vocab, seed=1))
            logits = engine.model(input_ids=ids).logits.float()  # [n, T, V]
        torch.save(torch.log_softmax(logits, dim=-1), args.workdir / f"logprobs-{args.run}.pt")
        rows, prompt, new = plan["greedy"]
        engine.generate(requests(token_rows(rows, prompt, vocab, seed=2), new))
        out["greedy"] = [engine.ids[i] for i in range(rows)]
    for name in ("b1", "working"):
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

    from batchgen.toymodel import build_model

    model = workdir / f"model-{size}"
    if not (model / "config.json").exists():
        rng = random.Random(0)
        words = "the river town market opened closed with many people after rain sun night lamp bread".split()
        build_model(model, [" ".join(rng.choice(words) for _ in range(200)) for _ in range(200)], size=size)
    return model


def spawn(args: argparse.Namespace, model: Path, config: str, *, fidelity: bool, params: int) -> dict:
    cmd = [sys.executable, __file__, "--run", config, "--model", str(model), "--workdir", str(args.workdir),
           "--params", str(params)] + (["--quick"] if args.quick else []) + (["--fidelity"] if fidelity else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fidelity(workdir: Path, config: str, ref_greedy: list[list[int]], greedy: list[list[int]]) -> dict:
    import torch

    ref = torch.load(workdir / "logprobs-none.pt")  # [n, T, V] log-probs
    cur = torch.load(workdir / f"logprobs-{config}.pt")
    top1 = (ref.argmax(-1) == cur.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - cur)).sum(-1).mean().item()
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None) for r, g in zip(ref_greedy, greedy)]
    differing = [f for f in firsts if f is not None]
    return {"top1": top1, "kl": kl, "greedy_identical": firsts.count(None) / len(firsts),
            "first_divergence": statistics.mean(differing) if differing else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--configs", help="comma-separated subset of " + ",".join(CONFIGS))
    parser.add_argument("--workdir", type=Path, default=ROOT / ".bench")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fidelity", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return child(args)
    plan = QUICK if args.quick else FULL
    configs = args.configs.split(",") if args.configs else list(plan["configs"])
    configs = ["none"] + [c for c in configs if c != "none"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build(args.workdir, plan["size"])
    params = _count_params(model)
    samples: dict[str, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.repeats or plan["repeats"]):
        for config in configs:  # interleaved: none, int8, int4, none, ...
            samples[config].append(spawn(args, model, config, fidelity=repeat == 0, params=params))
            print(f"repeat {repeat} {config}: {samples[config][-1]['tok_s_b1']:.1f} tok/s at B=1, "
                  f"{samples[config][-1]['tok_s_working']:.1f} at B={samples[config][-1]['working_batch']}",
                  file=sys.stderr)
    table = summarize(args.workdir, samples, params)
    print_table(table, plan["size"], params)
    if args.json:
        args.json.write_text(json.dumps({"rows": table, "samples": samples}, indent=1))


def summarize(workdir: Path, samples: dict[str, list[dict]], params: int) -> list[dict]:
    base = samples["none"]
    rows = []
    for config, runs in samples.items():
        first = runs[0]
        row = {"config": config, "dtype": first["dtype"], "weight_mb": first["weight_bytes"] / 1e6,
               "vs_bf16": first["weight_bytes"] / (2 * params),
               "vs_none": first["weight_bytes"] / base[0]["weight_bytes"],
               "peak_rss_mb": max(r["peak_rss"] for r in runs) / 1e6,
               "rss_after_load_mb": statistics.median(r["rss_after_load"] for r in runs) / 1e6,
               "working_batch": first["working_batch"]}
        for name in ("b1", "working"):
            row[f"tok_s_{name}"] = statistics.median(r[f"tok_s_{name}"] for r in runs)
            ratios = [r[f"tok_s_{name}"] / b[f"tok_s_{name}"] for r, b in zip(runs, base)]
            row[f"ratio_{name}"] = statistics.median(ratios)
        row.update(fidelity(workdir, config, base[0]["greedy"], first["greedy"]))
        rows.append(row)
    return rows


def print_table(rows: list[dict], size: str, params: int) -> None:
    print(f"\nmodel: {size} Llama, {params / 1e6:.1f}M params; ratios are medians of same-repeat ratios to 'none' "
          f"({rows[0]['dtype']})")
    print("| config | compute dtype | weight MB | vs bf16 | vs none | peak RSS MB | RSS after load MB "
          f"| tok/s B=1 | x none | tok/s B={rows[0]['working_batch']} | x none | top-1 | mean KL "
          "| greedy identical | first divergence |")
    print("|" + " --- |" * 15)
    for r in rows:
        div = "-" if r["first_divergence"] is None else f"{r['first_divergence']:.1f}"
        print(f"| {r['config']} | {r['dtype']} | {r['weight_mb']:.1f} | {r['vs_bf16']:.2f}x | {r['vs_none']:.2f}x "
              f"| {r['peak_rss_mb']:.0f} | {r['rss_after_load_mb']:.0f} | {r['tok_s_b1']:.1f} | {r['ratio_b1']:.2f}x "
              f"| {r['tok_s_working']:.1f} | {r['ratio_working']:.2f}x | {r['top1']:.1%} | {r['kl']:.4f} "
              f"| {r['greedy_identical']:.0%} | {div} |")


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
