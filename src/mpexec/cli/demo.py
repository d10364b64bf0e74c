"""``mpexec demo``: the default model, tensor-parallel on the CPU, answering chat prompts.

1. resolve the model (``default`` is fetched into the cache on first use,
   with progress) and start TP=2 worker processes (each loads its shard);
2. generate answers to a few chat prompts in one batch (continuous batching)
   and print each;
3. report output tokens/s, time to first token, and the executor's share of
   a step: the driver-side time of ``execute_model`` + ``sample_tokens`` that
   the output rank did not spend inside those methods (its
   ``worker_execute_s`` / ``worker_sample_s``), next to ``executor.stats()``;
4. shut down and check that no worker process is left.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, TextIO

from mpexec.cli.common import DEMO_CONVERSATIONS, Progress
from mpexec.cli.generate import start_llm
from mpexec.system import process_gone

PROCESS_EXIT_TIMEOUT_S = 10.0


def run(args: argparse.Namespace, out: TextIO) -> int:
    from mpexec.outputs import SamplingParams

    tp = args.tp if args.backend == "mp" else 1
    out.write(f"mpexec demo: model {args.model!r}, TP={tp} on the "
              f"{args.backend} executor, {len(DEMO_CONVERSATIONS)} chat prompts\n")
    out.flush()
    started = time.monotonic()
    # a KV cache for these few short chats, not for 64 requests of 8k tokens
    args.max_model_len, args.max_num_seqs = 1024, 2 * len(DEMO_CONVERSATIONS)
    llm = start_llm(args, tp, 1)
    pids = [w.proc.pid for w in getattr(llm.engine.executor, "workers", [])]
    out.write(f"  start        {tp} workers ready in {time.monotonic() - started:.1f} s "
              f"({llm.engine.num_blocks} KV blocks)\n\n")
    out.flush()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    progress = Progress()
    with llm:
        t0 = time.monotonic()
        try:
            outputs = llm.chat(DEMO_CONVERSATIONS, params, progress=lambda done, total, n:
                               progress.update(f"generating: {n} tokens, {done}/{total} done"))
        finally:
            progress.done()
        elapsed = time.monotonic() - t0
        for conversation, output in zip(DEMO_CONVERSATIONS, outputs, strict=True):
            out.write(f"Q: {conversation[-1]['content']}\n")
            out.write(f"A: {output.text.strip()}\n\n")
        _report(out, outputs, elapsed, llm.engine)
    deadline = time.monotonic() + PROCESS_EXIT_TIMEOUT_S
    while any(not process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if not process_gone(pid)]
    out.write(f"  shutdown     worker processes left: "
              f"{', '.join(map(str, left)) or 'none'}\n")
    return 0 if not left else 1


def _report(out: TextIO, outputs: list[Any], elapsed: float, engine: Any) -> None:
    tokens = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token_s for o in outputs
             if o.metrics.time_to_first_token_s is not None]
    out.write(f"  throughput   {tokens} tokens in {elapsed:.1f} s: "
              f"{tokens / elapsed:.1f} output tokens/s\n")
    if ttfts:
        out.write(f"  first token  median {statistics.median(ttfts) * 1e3:.0f} ms "
                  f"(max {max(ttfts) * 1e3:.0f} ms)\n")
    stats = engine.executor.stats()
    share = engine.stats.executor_share
    if share is not None:
        step_s = statistics.median(engine.stats.sync_step_s)
        worker_s = statistics.median(engine.stats.sync_worker_s)
        out.write(f"  executor     {share * 100:.2f}% of a step outside the workers "
                  f"(median step {step_s * 1e3:.1f} ms, inside the workers "
                  f"{worker_s * 1e3:.1f} ms; {engine.stats.steps} steps)\n")
    for name in ("execute_model", "sample_tokens"):
        if name in stats:
            s = stats[name]
            out.write(f"  {name:<15}{s.calls} calls, p50 {s.p50_s * 1e3:.2f} ms, "
                      f"p99 {s.p99_s * 1e3:.2f} ms (executor.stats())\n")
