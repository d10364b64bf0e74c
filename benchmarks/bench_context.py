"""Context parallelism: what DCP and PCP buy a long request.

    python benchmarks/bench_context.py [--context 4000] [--decode 32] [--threads 1]
                                       [--prefill 2000] [--model default] [--only dcp,pcp]
                                       [--dcp 2] [--pcp 2]

On a checkpoint written by transformers for the run (a Llama with one KV head,
so that TP=``--dcp`` replicates it: the layout DCP exists for; 4 layers,
hidden 256, 8192 positions), TP=``--dcp`` on the CPU with DCP=1 and DCP=``--dcp``
(2 by default):

1. KV bytes each rank holds for one ``--context``-token request (the blocks
   the scheduler gave it times the bytes a block costs on one rank); target
   DCP=2 <= 0.55x DCP=1;
2. the longest context admitted in the same per-rank KV budget (the engine's
   capacity in tokens, never more than the model's 8192 positions; a prompt
   of that length is run to prove it); target >= 1.8x;
3. decode tokens/s of that request (greedy, ``--decode`` tokens): DCP trades
   KV memory for two extra all-gathers per layer;
4. where a DCP decode step's time goes on rank 0 (``LLM.start_profile``
   spans): gathering the queries, the partial attention over the rank's
   share, and the merge (gathering every rank's partial outputs and
   log-sum-exps, then rescaling). Decode only: the spans of a run that
   stops after the first token are subtracted from those of the full run.

Prefill context parallelism on ``--model`` (SmolLM2 by default), TP=1:

5. time to first token of one ``--prefill``-token prompt with PCP=``--pcp``
   (2 by default) against PCP=1 (``--threads`` intra-op threads per worker; median of 3); target
   >= 1.4x faster.

Numbers depend on the machine and its load; compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import render  # noqa: E402

from mpexec.engine.llm import LLM  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

BLOCK = 16


def write_checkpoint(directory: Path) -> Path:
    from mpexec.models.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(directory, hidden_size=256, num_attention_heads=4,
                                 num_key_value_heads=1, num_hidden_layers=4,
                                 intermediate_size=512, max_position_embeddings=8192)


def make_llm(path: Path, tp: int, dcp: int, threads: int, budget: int | None = None) -> LLM:
    return LLM(str(path), tensor_parallel_size=tp, decode_context_parallel_size=dcp,
               num_threads=threads, block_size=BLOCK, max_num_seqs=1,
               max_num_batched_tokens=1024, kv_cache_memory_bytes=budget,
               enable_prefix_caching=False)


def prompt(length: int) -> dict[str, Any]:
    return {"prompt_token_ids": [(7 * i) % 90 + 5 for i in range(length)]}


def measure(path: Path, tp: int, dcp: int, context: int, decode: int, threads: int,
            budget: int) -> dict[str, Any]:
    with make_llm(path, tp, dcp, threads, budget) as llm:
        engine = llm.engine
        block_bytes = engine.executor.collective_rpc("kv_cache_block_bytes")[0]
        tokens_per_block = engine.scheduler.limits.block_size
        held = -(-(context + decode) // tokens_per_block) * block_bytes
        capacity = engine.num_blocks * tokens_per_block
        out = llm.generate(prompt(context), SamplingParams(temperature=0, max_tokens=decode,
                                                           ignore_eos=True))[0]
        metrics = out.metrics
        assert metrics.first_token_time is not None and metrics.finish_time is not None
        prefill_s = metrics.first_token_time - metrics.arrival_time
        decode_tok_s = (len(out.token_ids) - 1) / (metrics.finish_time - metrics.first_token_time)
        phases = decode_phases(llm, context, decode) if dcp > 1 else {}
        longest = min(capacity, engine.scheduler.limits.max_model_len) - 1
        admitted = llm.generate(prompt(longest), SamplingParams(temperature=0, max_tokens=1))
        assert len(admitted[0].token_ids) == 1
    return {"dcp": dcp, "held": held, "capacity": capacity, "longest": longest,
            "prefill_s": prefill_s, "decode_tok_s": decode_tok_s, "phases": phases}


def decode_phases(llm: LLM, context: int, decode: int) -> dict[str, float]:
    """Rank 0's share of the decode steps' time in each ``dcp.*`` span: the profile
    starts once the first token has come, so it holds decode steps only."""
    profiling = False
    stream = llm.generate_stream(prompt(context), SamplingParams(
        temperature=0, max_tokens=1 + decode, ignore_eos=True))
    for out in stream:
        if not profiling and out.outputs[0].token_ids:
            llm.start_profile()
            profiling = True
    rank0 = llm.stop_profile()[0]
    shares = {name: t.seconds / rank0.wall_s for name, t in rank0.spans.items()}
    shares["step_ms"] = rank0.wall_s / decode * 1e3
    return shares


def prefill_seconds(model: str, pcp: int, length: int, threads: int, reps: int = 3) -> float:
    """Median time to first token of one ``length``-token prompt."""
    with LLM(model, prefill_context_parallel_size=pcp, num_threads=threads, max_num_seqs=1,
             enable_prefix_caching=False,  # every repetition computes the whole prompt
             max_num_batched_tokens=length, max_model_len=length + 16) as llm:
        llm.generate(prompt(64), SamplingParams(temperature=0, max_tokens=1))  # warm up
        times = []
        for _ in range(reps):
            out = llm.generate(prompt(length), SamplingParams(temperature=0, max_tokens=1))[0]
            first = out.metrics.first_token_time
            assert first is not None
            times.append(first - out.metrics.arrival_time)
    return statistics.median(times)


def bench_pcp(args: argparse.Namespace) -> None:
    rows = [(pcp, prefill_seconds(args.model, pcp, args.prefill, args.threads))
            for pcp in (1, args.pcp)]
    base = rows[0][1]
    print(render(f"Prefill context parallelism, {args.model}, TP=1, one {args.prefill}-token "
                 f"prompt, {args.threads} thread(s) per worker (median of 3)",
                 ["layout", "time to first token s", "speed-up"],
                 [[f"PCP={p}", f"{s:.2f}", f"{base / s:.2f}x"] for p, s in rows]))
    print(f"target: PCP={args.pcp} >= 1.4x (got {base / rows[1][1]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=2000)
    parser.add_argument("--model", default="default")
    parser.add_argument("--only", default="dcp,pcp")
    parser.add_argument("--dcp", type=int, default=2,
                        help="the DCP size compared with DCP=1 (TP is the same)")
    parser.add_argument("--pcp", type=int, default=2,
                        help="the PCP size compared with PCP=1")
    args = parser.parse_args()
    if args.dcp < 2 or args.pcp < 2:
        parser.error("--dcp and --pcp compare a size of at least 2 with 1")
    if "dcp" in args.only:
        bench_dcp(args)
    if "pcp" in args.only:
        bench_pcp(args)


def bench_dcp(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "ckpt")
        tp = args.dcp  # one KV head: TP=D replicates it D times, which DCP=D undoes
        with make_llm(path, tp, 1, args.threads) as probe:
            block_bytes = probe.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
        # A per-rank budget that holds the request without DCP, with a little room.
        budget = (-(-(args.context + args.decode) // BLOCK) + 8) * block_bytes
        rows = [measure(path, tp, dcp, args.context, args.decode, args.threads, budget)
                for dcp in (1, args.dcp)]
    base, split = rows
    table = [[f"DCP={r['dcp']}", f"{r['held'] / 2**20:.2f}", f"{r['held'] / base['held']:.2f}x",
              r["capacity"], f"{r['capacity'] / base['capacity']:.2f}x",
              f"{r['prefill_s']:.2f}", f"{r['decode_tok_s']:.1f}"] for r in rows]
    print(render(f"Decode context parallelism, TP={tp}, one {args.context}-token request, "
                 f"per-rank KV budget {budget / 2**20:.1f} MiB, {args.threads} thread(s) "
                 "per worker",
                 ["layout", "KV MiB/rank", "vs DCP=1", "tokens admitted", "vs DCP=1",
                  "prefill s", "decode tok/s"], table))
    print(f"targets: KV per rank <= 0.55x (got {split['held'] / base['held']:.2f}x); "
          f"context admitted >= 1.8x (got {split['capacity'] / base['capacity']:.2f}x)")
    phases = split["phases"]
    names = [("dcp.gather_q", "gather the queries"),
             ("dcp.attention", "partial attention over the rank's share"),
             ("dcp.gather_out", "merge: gather partial outputs and LSEs"),
             ("dcp.merge", "merge: rescale and sum")]
    table = [[label, f"{100 * phases.get(name, 0.0):.1f}%"] for name, label in names]
    merge = phases.get("dcp.gather_out", 0.0) + phases.get("dcp.merge", 0.0)
    print(render(f"Where DCP={args.dcp} decode steps go, rank 0, all layers, profiled after "
                 f"the first token (about {phases['step_ms']:.1f} ms per step)",
                 ["phase", "share of the decode steps"], table))
    print(f"the merge's share of a decode step: {100 * merge:.1f}%")


if __name__ == "__main__":
    main()
