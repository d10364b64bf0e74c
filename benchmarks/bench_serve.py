"""Serving benchmark: the OpenAI server under 1..64 concurrent streaming clients,
against ``LLM.generate`` of the same requests, passes interleaved.

    python benchmarks/bench_serve.py [--model default] [--tp 1,2] [--clients 1,8,32,64]
                                     [--max-tokens 32] [--rounds 3] [--threads 1]
                                     [--kv-mib 512] [--async-scheduling] [--json FILE]
                                     [--profile DIR]

For each TP size the server runs in a child process (``AsyncLLM`` with
``--threads`` torch threads per worker, uvicorn on a free port) and the
offline ``LLM`` (the same model, TP, threads, batch cap and KV-cache size)
in this process, both loaded and warmed up before anything is timed.  For
each concurrency ``c`` the same ``max(c, 4)`` greedy requests (``ignore_eos``,
exactly ``--max-tokens`` tokens each) run ``--rounds`` times each way,
alternating (offline then server, then server then offline, ...), so that a
machine whose load drifts weighs on both alike: on a shared machine the
load, not the server, decides most of the wall time.  A server pass is
``c`` clients (httpx, one asyncio task each, streaming), measuring

- requests/s and output tokens/s over the load window;
- time to first token (send to the first chunk with text) and inter-token
  latency (gaps between chunks over the tokens they carry), p50 and p99;
- the server's own share of the window: the time the workers were not inside
  ``execute_model`` / ``sample_tokens`` (HTTP, detokenization, scheduling,
  waiting for clients), from the ``mpexec_engine_*`` counters of /metrics;
  and the executor's share of a step (driver time of a step outside the
  workers' methods).

An offline pass is one ``LLM.generate`` of the requests.  ``kept`` is the
median over rounds of server tok/s / offline tok/s of the same round.  The
second table says where the CPU went, per output token and independent of
the load: engine steps run, the workers' CPU, the front end's CPU (the
server process: HTTP, engine thread; offline: the driver) and the load
generator's own CPU (it shares the machine with the server), with the mean
1-minute load average over the passes.  ``--profile DIR`` runs the server's
engine thread and event loop under cProfile (``DIR/engine.prof``,
``DIR/loop.prof``; slower, for finding overhead, not for figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import (  # noqa: E402
    cpu_s_of,
    descendant_pids,
    machine_info,
    percentile,
    proc_cpu_s,
    render,
)

PROMPT = ("Write a short story about a robot that learns to paint. The robot lives in a "
          "small town by the sea, and every morning it")


def prompts(count: int) -> list[str]:
    return [f"{PROMPT} (story {i})" for i in range(count)]


# -- the server child ------------------------------------------------------------------

def serve_child(args: argparse.Namespace) -> int:
    from mpexec.engine.async_llm import AsyncLLM
    from mpexec.entrypoints.launch import serve

    engine = AsyncLLM(args.model, tensor_parallel_size=args.child_tp,
                      num_threads=args.threads, max_num_seqs=64,
                      kv_cache_memory_bytes=args.kv_mib << 20,
                      async_scheduling=args.async_scheduling)
    if args.profile is None:
        return serve(engine, host="127.0.0.1", port=args.port, model_names=["bench"],
                     grace_s=2.0)
    return _profiled(engine, args)


def _profiled(engine: Any, args: argparse.Namespace) -> int:
    """``serve`` with cProfile on the engine thread (its steps and its publishing of
    outputs, wrapped once the thread runs) and on the event loop's thread."""
    import cProfile

    from mpexec.entrypoints.launch import serve

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    engine_profile = cProfile.Profile()

    def profiled(method: Any) -> Any:
        def call() -> Any:
            engine_profile.enable()
            try:
                return method()
            finally:
                engine_profile.disable()
        return call

    engine.engine.step = profiled(engine.engine.step)
    engine._publish = profiled(engine._publish)
    loop_profile = cProfile.Profile()
    loop_profile.enable()
    try:
        return serve(engine, host="127.0.0.1", port=args.port, model_names=["bench"],
                     grace_s=2.0)
    finally:
        loop_profile.disable()
        loop_profile.dump_stats(out / "loop.prof")
        engine_profile.dump_stats(out / "engine.prof")


def start_server(args: argparse.Namespace, tp: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-child", "--child-tp", str(tp), "--port", str(port),
         "--model", args.model, "--threads", str(args.threads), "--kv-mib", str(args.kv_mib),
         *(["--profile", args.profile] if args.profile else []),
         *(["--async-scheduling"] if args.async_scheduling else [])],
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
        "wall_s": wall, "ttft": ttft, "itl": itl,
        "steps": delta.get("mpexec_engine_steps_total", 0.0),
        "server_share": max(0.0, wall - worker_s) / wall,
        "executor_share": (step_s - worker_s) / step_s if step_s else float("nan"),
    }


class Passes:
    """Timed passes of one TP size: the server child and the offline LLM, side by side.

    Each pass records its wall time, the CPU seconds of the workers, of the
    front end (the server process, or this process's driver) and, for a
    server pass, of this process (the load generator), and the 1-minute
    load average when it started.
    """

    def __init__(self, args: argparse.Namespace, tp: int, server: subprocess.Popen[bytes],
                 url: str, llm: Any) -> None:
        from mpexec import SamplingParams

        self.args, self.tp, self.server, self.url, self.llm = args, tp, server, url, llm
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                     ignore_eos=True)
        self.server_workers = descendant_pids(server.pid)
        self.offline_workers = descendant_pids(os.getpid()) - self.server_workers \
            - {server.pid}

    def server_pass(self, clients: int, requests: int) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            return asyncio.run(load(self.url, clients, requests, self.args.max_tokens))

        return self._timed(run, self.server_workers, self.server.pid)

    def offline_pass(self, requests: int) -> dict[str, Any]:
        stats = self.llm.engine.stats
        steps = stats.steps

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            self.llm.generate(prompts(requests), self.params)
            return {"wall_s": time.perf_counter() - started}

        row = self._timed(run, self.offline_workers, None)
        row["steps"] = stats.steps - steps
        return row

    def _timed(self, run: Any, workers: set[int], front_pid: int | None) -> dict[str, Any]:
        load_1m = os.getloadavg()[0]
        workers_before = sum(cpu_s_of(workers).values())
        front_before = proc_cpu_s(front_pid) if front_pid is not None else 0.0
        me_before = _own_cpu_s()
        row = run()
        me = _own_cpu_s() - me_before
        row["worker_cpu_s"] = sum(cpu_s_of(workers).values()) - workers_before
        if front_pid is None:  # offline: this process is the front end
            row["front_cpu_s"], row["client_cpu_s"] = me, 0.0
        else:
            row["front_cpu_s"] = proc_cpu_s(front_pid) - front_before
            row["client_cpu_s"] = me
        row["load_1m"] = load_1m
        return row


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def compare(passes: Passes, clients: int, rounds: int) -> dict[str, Any]:
    """``rounds`` server and offline passes of the same requests, alternating."""
    requests = max(clients, 4)
    served: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    for round_ in range(rounds):
        if round_ % 2 == 0:
            offline.append(passes.offline_pass(requests))
            served.append(passes.server_pass(clients, requests))
        else:
            served.append(passes.server_pass(clients, requests))
            offline.append(passes.offline_pass(requests))
    tokens = requests * passes.args.max_tokens
    ttft = [t for p in served for t in p["ttft"]]
    itl = [t for p in served for t in p["itl"]]

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    return {
        "tp": passes.tp, "clients": clients, "requests": requests, "rounds": rounds,
        "req_per_s": requests / median(served, "wall_s"),
        "tok_per_s": tokens / median(served, "wall_s"),
        "offline_tok_per_s": tokens / median(offline, "wall_s"),
        "kept": statistics.median(o["wall_s"] / s["wall_s"]
                                  for s, o in zip(served, offline, strict=True)),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50) if itl else float("nan"),
        "itl_p99": percentile(itl, 99) if itl else float("nan"),
        "server_share": median(served, "server_share"),
        "executor_share": median(served, "executor_share"),
        "steps": median(served, "steps"), "offline_steps": median(offline, "steps"),
        "worker_ms_per_tok": median(served, "worker_cpu_s") / tokens * 1e3,
        "offline_worker_ms_per_tok": median(offline, "worker_cpu_s") / tokens * 1e3,
        "front_ms_per_tok": median(served, "front_cpu_s") / tokens * 1e3,
        "offline_front_ms_per_tok": median(offline, "front_cpu_s") / tokens * 1e3,
        "client_ms_per_tok": median(served, "client_cpu_s") / tokens * 1e3,
        "load_1m": statistics.fmean(p["load_1m"] for p in served + offline),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--clients", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3,
                        help="server and offline passes per row, alternating (3)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-mib", type=int, default=512,
                        help="KV cache of the server and of the offline LLM (512 MiB)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="both the server and the offline LLM schedule step N+1 while "
                        "step N runs")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="cProfile the server's engine thread and event loop into DIR")
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_child:
        return serve_child(args)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from mpexec import LLM, SamplingParams

    info = machine_info()
    rows: list[dict[str, Any]] = []
    for tp in [int(x) for x in args.tp.split(",")]:
        proc, url = start_server(args, tp)
        try:
            with LLM(args.model, tensor_parallel_size=tp, num_threads=args.threads,
                     max_num_seqs=64, kv_cache_memory_bytes=args.kv_mib << 20,
                     async_scheduling=args.async_scheduling) as llm:
                llm.generate(prompts(2), SamplingParams(temperature=0, max_tokens=4))
                asyncio.run(load(url, 1, 2, 4))  # warm up
                passes = Passes(args, tp, proc, url, llm)
                for clients in [int(x) for x in args.clients.split(",")]:
                    rows.append(compare(passes, clients, args.rounds))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    title = (f"mpexec serve, {args.model}, {args.max_tokens} tokens per request, "
             f"{args.threads} thread(s) per worker, medians of {args.rounds} interleaved "
             f"rounds ({info['cpu']}, {info['affinity']} CPUs)")
    print(render(title, [
        "TP", "clients", "requests", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
        "ITL p50 ms", "ITL p99 ms", "server share", "executor share", "LLM.generate tok/s",
        "kept"], [[
            r["tp"], r["clients"], r["requests"], f"{r['req_per_s']:.2f}",
            f"{r['tok_per_s']:.1f}", f"{r['ttft_p50'] * 1e3:.0f}",
            f"{r['ttft_p99'] * 1e3:.0f}", f"{r['itl_p50'] * 1e3:.1f}",
            f"{r['itl_p99'] * 1e3:.1f}", f"{r['server_share']:.1%}",
            f"{r['executor_share']:.1%}", f"{r['offline_tok_per_s']:.1f}",
            f"{r['kept']:.0%}"] for r in rows], left=0))
    print()
    print(render("CPU per output token (ms), server / offline", [
        "TP", "clients", "steps", "workers", "front end", "load generator", "load avg"], [[
            r["tp"], r["clients"], f"{r['steps']:.0f} / {r['offline_steps']:.0f}",
            f"{r['worker_ms_per_tok']:.2f} / {r['offline_worker_ms_per_tok']:.2f}",
            f"{r['front_ms_per_tok']:.2f} / {r['offline_front_ms_per_tok']:.2f}",
            f"{r['client_ms_per_tok']:.2f}", f"{r['load_1m']:.1f}"] for r in rows], left=0))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
