"""What the sampling controls cost in the sampler, per step.

    python benchmarks/bench_sampler.py [--rows 32] [--vocab 49152] [--history 512]
                                       [--repeats 30] [--threads 1]

Times ``mpexec.models.sampler.sample`` on random float32 logits ``[rows,
vocab]`` (SmolLM2's vocabulary by default) for one decode step of every row:
plain greedy and seeded top-p sampling, then each with penalties
(repetition + frequency + presence, every row, a ``--history``-token
history already counted), ``logit_bias`` and ``min_tokens``, and top-5
logprobs.  The penalties' count vectors are brought up to date by one token
per step, as in a decode.  Prints the median and p90 milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import percentile, render  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--history", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from mpexec.models.sampler import SampleRequest, TokenHistory, sample
    from mpexec.outputs import SamplingParams

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=generator) * 3
    penalties = {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    cases = {
        "greedy": {"temperature": 0},
        "greedy + penalties": {"temperature": 0, **penalties},
        "greedy + logit_bias (8 ids) + min_tokens": {
            "temperature": 0, "logit_bias": {i: 1.0 for i in range(8)},
            "min_tokens": 10, "max_tokens": 100},
        "greedy + top-5 logprobs": {"temperature": 0, "logprobs": 5},
        "top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
        "top_p 0.9 + penalties": {"temperature": 0.8, "top_p": 0.9, **penalties},
    }
    rows = []
    for name, fields in cases.items():
        params = SamplingParams(**fields)  # type: ignore[arg-type]
        histories = []
        for _ in range(args.rows):
            tokens = torch.randint(0, args.vocab, (args.history,), generator=generator).tolist()
            histories.append(TokenHistory(tokens, args.history // 2) if params.has_penalties
                             else None)
        times = []
        for step in range(args.repeats + 3):
            requests = []
            for row, history in enumerate(histories):
                if history is not None:
                    history.token_ids.append((row * 7919 + step) % args.vocab)
                position = args.history + step + 1
                requests.append(SampleRequest(params, row, position, num_output_tokens=5,
                                              min_tokens_stop_ids=(2,), history=history))
            started = time.perf_counter()
            sample(logits, requests)
            if step >= 3:  # the first calls count the whole history
                times.append((time.perf_counter() - started) * 1000)
        rows.append([name, f"{statistics.median(times):.2f}", f"{percentile(times, 90):.2f}"])
    print(render(f"sample(): {args.rows} rows x {args.vocab} vocab, {args.threads} thread(s), "
                 f"{args.repeats} calls", ["case", "median ms", "p90 ms"], rows))


if __name__ == "__main__":
    main()
