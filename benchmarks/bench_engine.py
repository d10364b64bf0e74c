"""Engine benchmarks: what batching and async scheduling buy, and what the executor costs.

Prints three tables from one run::

    python benchmarks/bench_engine.py [--model default] [--requests 32] [--sequential 4]
                                      [--prompt-len 128] [--max-tokens 64] [--layouts tp1,tp2,pp2]
                                      [--threads 1]

For each layout (TP=1, TP=2, PP=2 on the CPU):

1. batching: output tokens/s of ``--requests`` requests (``--prompt-len``
   prompt tokens, ``--max-tokens`` output tokens, EOS ignored) arriving at
   once, against the same requests one at a time (the first ``--sequential``
   of them: a rate, so a subset measures it); target >= 5x;
2. async scheduling on vs off, all requests at once: tokens/s; target: on is
   faster, and PP=2 with two micro-batches in flight beats PP=2 with one;
3. the executor's share of a step (synchronous steps): driver-side time of
   ``execute_model`` + ``sample_tokens`` that the output rank did not spend
   inside them (``worker_execute_s`` / ``worker_sample_s``); target < 2%.

Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import percentile, render  # noqa: E402

from mpexec.engine.llm import LLM  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def prompts(n: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(length)]}
            for _ in range(n)]


def timed(llm: LLM, batch: list[dict[str, Any]], params: SamplingParams) -> dict[str, float]:
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token_s or 0.0 for o in outputs]
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "ttft_p50": percentile(ttfts, 50)}


def one_at_a_time(llm: LLM, batch: list[dict[str, Any]],
                  params: SamplingParams) -> dict[str, float]:
    started = time.perf_counter()
    tokens = 0
    ttfts = []
    for prompt in batch:
        (output,) = llm.generate([prompt], params)
        tokens += len(output.token_ids)
        ttfts.append(output.metrics.time_to_first_token_s or 0.0)
    elapsed = time.perf_counter() - started
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "ttft_p50": percentile(ttfts, 50)}


def start(args: argparse.Namespace, tp: int, pp: int, async_scheduling: bool) -> LLM:
    return LLM(args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               async_scheduling=async_scheduling, max_num_seqs=max(64, args.requests),
               max_model_len=args.prompt_len + args.max_tokens + 16,
               num_threads=args.threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--sequential", type=int, default=4,
                        help="requests timed one at a time (a subset: tokens/s is a rate)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--layouts", default="tp1,tp2,pp2")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker (1: the layouts compare fairly)")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests, args.prompt_len)
    batching, async_rows, share_rows = [], [], []
    for name in args.layouts.split(","):
        tp, pp = LAYOUTS[name]
        with start(args, tp, pp, async_scheduling=False) as llm:
            timed(llm, batch[:2], SamplingParams(max_tokens=4))  # warm-up
            llm.engine.stats.sync_step_s.clear()
            llm.engine.stats.sync_worker_s.clear()
            seq = one_at_a_time(llm, batch[: args.sequential], params)
            sync = timed(llm, batch, params)
            stats = llm.engine.stats
            share = stats.executor_share
            step_ms = statistics.median(stats.sync_step_s) * 1e3 if stats.sync_step_s else 0.0
            worker_ms = statistics.median(stats.sync_worker_s) * 1e3 \
                if stats.sync_worker_s else 0.0
        with start(args, tp, pp, async_scheduling=True) as llm:
            timed(llm, batch[:2], SamplingParams(max_tokens=4))
            asyn = timed(llm, batch, params)
            in_flight = llm.engine.max_steps_in_flight
        ratio = sync["tok_s"] / seq["tok_s"]
        batching.append([name, f"{seq['tok_s']:.1f}", f"{sync['tok_s']:.1f}", f"{ratio:.1f}x",
                         "yes" if ratio >= 5 else "NO"])
        async_rows.append([name, f"{sync['tok_s']:.1f}", f"{asyn['tok_s']:.1f}", str(in_flight),
                           f"{asyn['tok_s'] / sync['tok_s']:.2f}x",
                           f"{sync['ttft_p50'] * 1e3:.0f}", f"{asyn['ttft_p50'] * 1e3:.0f}"])
        share_rows.append([name, f"{step_ms:.2f}", f"{worker_ms:.2f}",
                           "-" if share is None else f"{share * 100:.2f}%",
                           "-" if share is None else ("yes" if share < 0.02 else "NO")])
        print(f"# {name} done", file=sys.stderr, flush=True)
    print(render(f"1. batching: {args.requests} requests x {args.prompt_len} prompt tokens x "
                 f"{args.max_tokens} output tokens, output tokens/s (target >= 5x)",
                 ["layout", f"one at a time ({args.sequential})", "all at once", "ratio",
                  ">= 5x"], batching))
    print()
    print(render("2. async scheduling, all at once: output tokens/s",
                 ["layout", "sync", "async", "steps in flight", "async/sync",
                  "TTFT p50 sync ms", "TTFT p50 async ms"], async_rows))
    print()
    print(render("3. the executor's share of a synchronous step (target < 2%)",
                 ["layout", "step p50 ms", "in the workers p50 ms", "share", "< 2%"],
                 share_rows))


if __name__ == "__main__":
    main()
