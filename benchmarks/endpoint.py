"""engine=openai against a plain async client: rows per second through the same vLLM server, same run.

    python benchmarks/endpoint.py                         # starts `vllm serve` from .venv-vllm on a small model
    python benchmarks/endpoint.py --base-url http://127.0.0.1:8000/v1 --served NAME --tokenizer DIR

Workload (seeded): `--rows` prompts of 5 to 40 words, `--new-tokens` new tokens each (EOS ignored, greedy), at most
`--concurrency` requests in flight. "batchgen": the whole job in-process (reading the JSONL, rendering, tokenizing,
the requests, journaling, committing Parquet parts), its generation time (the job's wall time less its start-up).
"plain": an asyncio client (httpx.AsyncClient, a semaphore of the same concurrency) sending the same token-id prompts
with the same settings and keeping the answers in memory. The two alternate (A B A B ...); the ratio is batchgen's
rows/s over plain's, per repeat and as the median of those; and the CPU seconds each client spent (on a machine
whose cores the server also uses, the client's CPU is the server's loss). Printed beside the figures: the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompts(rows: int, seed: int = 5) -> list[str]:
    from batchgen.engines.toymodel import BENCH_WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(BENCH_WORDS) for _ in range(rng.randint(5, 40))) for _ in range(rows)]


def start_server(python: str, model: str, served: str) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(tempfile.gettempdir()) / "batchgen-bench-vllm-serve.log", "w")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited; see {log.name}")
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(2)
    proc.kill()
    raise SystemExit(f"vllm serve did not start in 10 min; see {log.name}")


def run_batchgen(url: str, served: str, tokenizer: str, data: Path, new_tokens: int, concurrency: int) -> float:
    """Seconds of the job's generation (its wall time less start-up), a fresh output_dir each time."""
    from batchgen.commands.compose import compose_checked
    from batchgen.run.runner import run_job

    out = Path(tempfile.mkdtemp(prefix="batchgen-bench-endpoint-"))
    try:
        cfg = compose_checked(["name=bench", f"output_dir={out / 'out'}", f"dataset.path={data}",
                               "dataset.format=jsonl", "run.progress=false", "engine=openai",
                               f"engine.base_url={url}", f"engine.model={served}", f"engine.tokenizer={tokenizer}",
                               f"engine.max_concurrency={concurrency}", f"sampling.max_new_tokens={new_tokens}",
                               "sampling.ignore_eos=true"])
        summary = run_job(cfg)
        assert summary.totals.rows == summary.totals.samples and not summary.totals.errors
        return summary.wall_s - summary.load_s
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_plain(url: str, served: str, ids: list[list[int]], new_tokens: int, concurrency: int) -> float:
    """Seconds for a plain asyncio client to get every answer."""
    import httpx

    async def main() -> float:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url + "/", timeout=600, limits=limits) as client:
            async def one(prompt: list[int]) -> dict:
                async with gate:
                    r = await client.post("completions", json={
                        "model": served, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                        "top_p": 1.0, "n": 1, "ignore_eos": True})
                    r.raise_for_status()
                    return r.json()

            start = time.perf_counter()
            answers = await asyncio.gather(*(one(p) for p in ids))
            elapsed = time.perf_counter() - start
        assert all(a["usage"]["completion_tokens"] == new_tokens for a in answers)
        return elapsed

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--served", default="bench")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from batchgen.engines.hf.backends.cpu.kernels import describe_cpu
    from batchgen.engines.toymodel import build_model

    proc = None
    model = args.tokenizer
    if args.base_url is None:
        model = str(ROOT / ".bench" / "endpoint-model")
        if not Path(model, "config.json").exists():
            build_model(Path(model), prompts(400, seed=1), size="small", max_position_embeddings=1024)
        proc, url = start_server(args.vllm_python, model, args.served)
    else:
        url = args.base_url
    try:
        texts = prompts(args.rows)
        data = Path(tempfile.mkdtemp(prefix="batchgen-bench-data-")) / "in.jsonl"
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        tok = AutoTokenizer.from_pretrained(model)
        ids = [tok(t)["input_ids"] for t in texts]
        run_plain(url, args.served, ids[:8], 4, 4)  # warm the server, and batchgen's first-job imports
        warm = data.with_name("warm.jsonl")
        warm.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts[:8]))
        run_batchgen(url, args.served, model, warm, 4, 4)
        ours, plain, cpu = [], [], {"batchgen": [], "plain": []}
        for _ in range(args.repeats):
            start = time.process_time()
            ours.append(run_batchgen(url, args.served, model, data, args.new_tokens, args.concurrency))
            cpu["batchgen"].append(time.process_time() - start)
            start = time.process_time()
            plain.append(run_plain(url, args.served, ids, args.new_tokens, args.concurrency))
            cpu["plain"].append(time.process_time() - start)
        ratios = [p / o for o, p in zip(ours, plain)]
        print(describe_cpu())
        print(f"{args.rows} rows x {args.new_tokens} new tokens, concurrency {args.concurrency}, vLLM server at {url}")
        print("batchgen rows/s: " + ", ".join(f"{args.rows / s:.1f}" for s in ours))
        print("plain    rows/s: " + ", ".join(f"{args.rows / s:.1f}" for s in plain))
        print("client CPU s (this process, user + system): " + "; ".join(
            f"{name} {statistics.median(times):.2f}" for name, times in cpu.items()))
        median = statistics.median(ratios)
        print("batchgen / plain: " + ", ".join(f"{r:.3f}" for r in ratios) + f"; median {median:.3f}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
