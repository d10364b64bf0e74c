"""Serving benchmark: the OpenAI server under 1..64 concurrent streaming clients.

    python benchmarks/bench_serve.py [--model default] [--tp 1,2] [--clients 1,8,32,64]
                                     [--max-tokens 32] [--threads 1] [--json FILE]

For each TP size: the server runs in a child process (``AsyncLLM`` with
``--threads`` torch threads per worker, uvicorn on a free port); this process
is the load: for each concurrency ``c``, ``c`` clients (httpx, one asyncio
task each) send ``max(c, 4)`` greedy streaming completions (``ignore_eos``,
exactly ``--max-tokens`` tokens each) and measure

- requests/s and output tokens/s over the load window;
- time to first token (send to the first chunk with text) and inter-token
  latency (gaps between chunks over the tokens they carry), p50 and p99;
- the server's own share of the window: the time the workers were not inside
  ``execute_model`` / ``sample_tokens`` (HTTP, detokenization, scheduling,
  waiting for clients), from the ``mpexec_engine_*`` counters of /metrics;
  and the executor's share of a step (driver time of a step outside the
  workers' methods);

then, with the server stopped, ``LLM.generate`` of the same requests in this
process (the offline rate); the last column is the server's output tokens/s
as a fraction of it.  Numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import machine_info, percentile, render  # noqa: E402

PROMPT = ("Write a short story about a robot that learns to paint. The robot lives in a "
          "small town by the sea, and every morning it")


def prompts(count: int) -> list[str]:
    return [f"{PROMPT} (story {i})" for i in range(count)]


# -- the server child ------------------------------------------------------------------

def serve_child(args: argparse.Namespace) -> int:
    from mpexec.engine.async_llm import AsyncLLM
    from mpexec.entrypoints.launch import serve

    engine = AsyncLLM(args.model, tensor_parallel_size=args.child_tp,
                      num_threads=args.threads, max_num_seqs=64)
    return serve(engine, host="127.0.0.1", port=args.port, model_names=["bench"],
                 grace_s=2.0)


def start_server(args: argparse.Namespace, tp: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-child", "--child-tp", str(tp), "--port", str(port),
         "--model", args.model, "--threads", str(args.threads)],
        env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("the server did not start")


def scrape(url: str) -> dict[str, float]:
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("mpexec_engine_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# -- the load ---------------------------------------------------------------------------

async def one_request(client: Any, url: str, prompt: str, max_tokens: int,
                      ttft: list[float], itl: list[float]) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - sent)
            else:
                itl.append(now - last)
            last = now
            tokens += 1
    return tokens


async def load(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    todo = list(prompts(requests))
    ttft: list[float] = []
    itl: list[float] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker() -> None:
            while todo:
                await one_request(client, url, todo.pop(), max_tokens, ttft, itl)

        before = scrape(url)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - started
        after = scrape(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    step_s = delta.get("mpexec_engine_step_seconds_total", 0.0)
    worker_s = delta.get("mpexec_engine_worker_seconds_total", 0.0)
    return {
        "clients": clients, "requests": requests, "wall_s": wall,
        "req_per_s": requests / wall, "tok_per_s": requests * max_tokens / wall,
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50) if itl else float("nan"),
        "itl_p99": percentile(itl, 99) if itl else float("nan"),
        "server_share": max(0.0, wall - worker_s) / wall,
        "executor_share": (step_s - worker_s) / step_s if step_s else float("nan"),
    }


def offline(args: argparse.Namespace, tp: int, counts: list[int]) -> dict[int, float]:
    """Output tokens/s of ``LLM.generate`` for each number of requests (one model load)."""
    from mpexec import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = {}
    with LLM(args.model, tensor_parallel_size=tp, num_threads=args.threads,
             max_num_seqs=64) as llm:
        llm.generate(prompts(2), params)  # warm up
        for requests in counts:
            started = time.perf_counter()
            llm.generate(prompts(requests), params)
            rates[requests] = requests * args.max_tokens / (time.perf_counter() - started)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--clients", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child:
        return serve_child(args)
    info = machine_info()
    rows: list[dict[str, Any]] = []
    for tp in [int(x) for x in args.tp.split(",")]:
        proc, url = start_server(args, tp)
        try:
            asyncio.run(load(url, 1, 2, 4))  # warm up
            for clients in [int(x) for x in args.clients.split(",")]:
                row = asyncio.run(load(url, clients, max(clients, 4), args.max_tokens))
                rows.append({"tp": tp, **row})
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        mine = [row for row in rows if row["tp"] == tp]
        rates = offline(args, tp, sorted({row["requests"] for row in mine}))
        for row in mine:
            row["offline_tok_per_s"] = rates[row["requests"]]
            row["kept"] = row["tok_per_s"] / row["offline_tok_per_s"]
    table = [[r["tp"], r["clients"], r["requests"], f"{r['req_per_s']:.2f}",
              f"{r['tok_per_s']:.1f}", f"{r['ttft_p50'] * 1e3:.0f}",
              f"{r['ttft_p99'] * 1e3:.0f}", f"{r['itl_p50'] * 1e3:.1f}",
              f"{r['itl_p99'] * 1e3:.1f}", f"{r['server_share']:.1%}",
              f"{r['executor_share']:.1%}", f"{r['offline_tok_per_s']:.1f}",
              f"{r['kept']:.0%}"] for r in rows]
    print(render(
        f"mpexec serve, {args.model}, {args.max_tokens} tokens per request, "
        f"{args.threads} thread(s) per worker ({info['cpu']}, {info['affinity']} CPUs, "
        f"load {info['loadavg_at_start']})",
        ["TP", "clients", "requests", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
         "ITL p50 ms", "ITL p99 ms", "server share", "executor share", "LLM.generate tok/s",
         "kept"], table, left=0))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
