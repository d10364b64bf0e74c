"""Speculative decoding with prompt-lookup drafts: what it buys, where it costs.

::

    python benchmarks/bench_spec.py [--model default] [--k 4] [--repeats 3]
                                    [--lookup-max 5] [--lookup-min 2] [--fixed-drafts]
                                    [--backend uni] [--threads 1] [--json out.json]

Two greedy tasks on one request at a time (batch 1, where decoding is
bound by reading the weights and a wider forward pass costs little more):

1. repetitive: rewrite a ~300-token Python snippet with one change (a
   renamed function), so most of the answer is a copy of the prompt;
   target: output tokens/s with ``k`` drafts >= 1.5x without.  The snippet
   comes first and the instruction after it: with the instruction first,
   SmolLM2-135M wrote a different program (a third of its lines from the
   snippet), which no drafting can speed up much;
2. free chat: open questions whose answers quote little; target >= 0.95x.

Both engines (drafts off and on) live side by side and the runs alternate,
so a change in the machine's load hits both; the table shows medians, the
speed-up in wall time and per CPU second of this process (all of the work
with the ``uni`` backend and one thread: less disturbed by others), the
acceptance rate (accepted / drafted tokens), the mean tokens a step emits
for a request that carried drafts, the acceptances per draft position, and
whether the outputs were identical.  The header names the CPU and the load
average (other processes share this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import render  # noqa: E402
from harness.machine import machine_info  # noqa: E402

from mpexec.engine.llm import LLM  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

SNIPPET = '''\
import csv
from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    item: str
    quantity: int
    unit_price: float


def read_orders(path):
    orders = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            orders.append(Order(row["customer"], row["item"], int(row["quantity"]),
                                float(row["unit_price"])))
    return orders


def compute_totals(orders):
    totals = {}
    for order in orders:
        amount = order.quantity * order.unit_price
        totals[order.customer] = totals.get(order.customer, 0.0) + amount
    return totals


def top_customers(totals, count=3):
    ranked = sorted(totals.items(), key=lambda pair: pair[1], reverse=True)
    return ranked[:count]


def main(path):
    orders = read_orders(path)
    totals = compute_totals(orders)
    for customer, amount in top_customers(totals):
        print(f"{customer}: {amount:.2f}")


if __name__ == "__main__":
    main("orders.csv")
'''

TASKS = {
    "repetitive": [
        f"```python\n{SNIPPET}```\n\nRewrite the code above, renaming the function "
        "compute_totals to sum_by_customer everywhere. Output the complete code and "
        "nothing else.",
    ],
    "free chat": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "What are three good habits for staying healthy while working from home?",
    ],
}


def run(llm: LLM, prompts: list[dict[str, Any]], params: SamplingParams,
        ) -> tuple[float, float, int, list[list[int]]]:
    """Wall and CPU seconds (this process's: all of it with the ``uni``
    backend), output tokens, and the outputs."""
    started, cpu = time.perf_counter(), time.process_time()
    outputs = [llm.generate([p], params)[0].outputs[0] for p in prompts]  # batch 1
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    return elapsed, cpu, tokens, [list(o.token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens (4)")
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--fixed-drafts", action="store_true",
                        help="always propose k drafts (draft_by_match off, as vLLM)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400, help="repetitive task (400)")
    parser.add_argument("--chat-tokens", type=int, default=128, help="free chat (128)")
    parser.add_argument("--backend", choices=("uni", "mp"), default="uni")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    info = machine_info()
    print(f"# bench_spec: {args.model}, k={args.k}, n-grams {args.lookup_min}..{args.lookup_max}"
          f" ({'k drafts' if args.fixed_drafts else 'at most n - 1 drafts after n matched'})"
          f", backend {args.backend}, {args.threads} intra-op thread(s)")
    print(f"# cpu {info['cpu']!r}, {info['affinity']} usable CPUs, load "
          f"{info['loadavg_at_start']} at start")
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min,
            "draft_by_match": not args.fixed_drafts}
    common = dict(executor_backend=args.backend, num_threads=args.threads, max_num_seqs=4,
                  max_model_len=2048, enable_prefix_caching=False)
    engines = {"off": LLM(args.model, **common), "on": LLM(args.model, speculative_config=spec,
                                                            **common)}
    rows, results = [], {}
    try:
        for task, texts in TASKS.items():
            max_tokens = args.max_tokens if task == "repetitive" else args.chat_tokens
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            prompts = engines["off"].chat_prompts([[{"role": "user", "content": t}]
                                                   for t in texts])
            rates: dict[str, list[float]] = {"off": [], "on": []}
            cpu_rates: dict[str, list[float]] = {"off": [], "on": []}
            outputs: dict[str, list[list[int]]] = {}
            stats = engines["on"].engine.stats
            before = (stats.spec_num_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens,
                      list(stats.spec_accepted_per_position))
            run(engines["off"], prompts, SamplingParams(temperature=0, max_tokens=8))  # warm
            run(engines["on"], prompts, SamplingParams(temperature=0, max_tokens=8))
            before = (stats.spec_num_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens,
                      list(stats.spec_accepted_per_position))
            for _ in range(args.repeats):
                for name in ("off", "on"):
                    elapsed, cpu, tokens, outputs[name] = run(engines[name], prompts, params)
                    rates[name].append(tokens / elapsed)
                    cpu_rates[name].append(tokens / cpu)
            stats = engines["on"].engine.stats
            drafts = stats.spec_num_drafts - before[0]
            drafted = stats.spec_draft_tokens - before[1]
            accepted = stats.spec_accepted_tokens - before[2]
            per_position = [a - b for a, b in zip(
                stats.spec_accepted_per_position,
                before[3] + [0] * (len(stats.spec_accepted_per_position) - len(before[3])),
                strict=True)]
            off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
            cpu_speedup = statistics.median(cpu_rates["on"]) / statistics.median(cpu_rates["off"])
            result = {
                "tokens": sum(len(t) for t in outputs["on"]), "off_tok_s": off, "on_tok_s": on,
                "speedup": on / off, "cpu_speedup": cpu_speedup,
                "acceptance_rate": accepted / drafted if drafted else None,
                "tokens_per_draft_step": (accepted + drafts) / drafts if drafts else None,
                "accepted_per_position": [round(a / drafts, 2) if drafts else 0
                                          for a in per_position],
                "identical": outputs["on"] == outputs["off"], "rates": rates,
                "cpu_rates": cpu_rates,
            }
            results[task] = result
            rows.append([task, result["tokens"], f"{off:.1f}", f"{on:.1f}",
                         f"{on / off:.2f}x", f"{cpu_speedup:.2f}x",
                         f"{result['acceptance_rate'] or 0:.2f}",
                         f"{result['tokens_per_draft_step'] or 0:.2f}",
                         " ".join(f"{a:.2f}" for a in result["accepted_per_position"]),
                         "yes" if result["identical"] else "NO"])
    finally:
        for llm in engines.values():
            llm.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": info,
                                               "results": results}, indent=1))
    print(render(f"greedy, batch 1, median of {args.repeats} (tokens/s of output)",
                 ["task", "tokens", "off tok/s", f"k={args.k} tok/s", "speed-up",
                  "per CPU s", "accepted", "tok/draft step", "accepted by position",
                  "identical"], rows))
    print(f"# load {[round(x, 2) for x in os.getloadavg()]} at end")


if __name__ == "__main__":
    main()
