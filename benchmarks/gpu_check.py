"""The model on one CUDA GPU: mpexec against transformers, uni against mp.

Run by ``benchmarks/gpu_check.sh`` (which checks first that there is a GPU
and a CUDA build of torch); on its own::

    PYTHONPATH=src python benchmarks/gpu_check.py [--tokens 24]

On a tiny random Llama written here (``mpexec.models.testing``), for
float32 and bfloat16, each on the ``uni`` and the ``mp`` backend at TP=1 on
``cuda:0``:

- greedy tokens from ``LLM.generate``;
- the same checkpoint in transformers on the same GPU and dtype, teacher
  forced over prompt + our tokens: its argmax at every step must be our
  token (float32: all of them; bfloat16: rounding may flip a near tie, so
  at least ``--bf16-agree`` of them, and the first token always);
- ``uni`` and ``mp`` must give the same tokens (same kernels, same GPU);
- the executor's torch.distributed backend is NCCL and the worker's device
  is ``cuda:0``.

``--device cpu`` runs the same cases on the CPU (gloo): a dry run of this
script's logic on a machine without a GPU, not a GPU result.

Prints one table row per case and exits 1 if any check failed, 0 when all
passed, and 0 with a "skipped" line when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = ["hello world", "the quick brown fox", "a", "one two three four five six seven"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--bf16-agree", type=float, default=0.9,
                        help="bfloat16: the least share of tokens transformers must agree on")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of this script's own logic on a CPU machine")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: skipped: torch {torch.__version__} sees no CUDA device")
        return 0
    from mpexec.models.testing import write_tiny_checkpoint

    if args.device == "cuda":
        print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    else:
        print(f"gpu_check: DRY RUN on the CPU (torch {torch.__version__}): not a GPU result")
    rows: list[list[str]] = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="mpexec-gpu-check-") as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp) / "tiny")
        tokens: dict[tuple[str, str], list[list[int]]] = {}
        for dtype in ("float32", "bfloat16"):
            for backend in ("uni", "mp"):
                ok, row, out = run_case(checkpoint, backend, dtype, args)
                tokens[(backend, dtype)] = out
                failed |= not ok
                rows.append(row)
            same = tokens[("uni", dtype)] == tokens[("mp", dtype)]
            failed |= not same
            rows.append([f"uni == mp ({dtype})", "", "", "", "",
                         "PASS" if same else "FAIL: uni and mp differ"])
    render(["case", "backend", "dtype", "transformers agrees", "generate s", "result"], rows)
    return 1 if failed else 0


def run_case(checkpoint: Path, backend: str, dtype: str,
             args: argparse.Namespace) -> tuple[bool, list[str], list[list[int]]]:

    from mpexec import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    problems: list[str] = []
    # A small KV cache: the default takes most of the GPU's free memory, which
    # the transformers reference then needs.
    device = args.device
    with LLM(str(checkpoint), executor_backend=backend, dtype=dtype, device=device,
             max_num_batched_tokens=256, kv_cache_memory_bytes=256 << 20,
             num_threads=None if device == "cuda" else 1) as llm:
        config = llm.engine.executor.config
        want_backend = "nccl" if device == "cuda" else "gloo"
        if config.device_type != device or config.parallel.backend != want_backend:
            problems.append(f"device {config.device_type}, backend {config.parallel.backend}")
        devices = llm.engine.executor.collective_rpc(lambda w: str(w.worker.device))
        if devices != ["cuda:0" if device == "cuda" else "cpu"]:
            problems.append(f"worker device {devices}")
        started = time.perf_counter()
        outputs = llm.generate(PROMPTS, params)
        elapsed = time.perf_counter() - started
        prompts = [list(o.prompt_token_ids) for o in outputs]
    out = [list(o.outputs[0].token_ids) for o in outputs]
    agree, total, first_ok = teacher_forced_agreement(checkpoint, dtype, prompts, out,
                                                      "cuda:0" if device == "cuda" else "cpu")
    need = 1.0 if dtype == "float32" else args.bf16_agree
    if agree < need * total or not first_ok:
        problems.append(f"transformers agrees on {agree}/{total} tokens (needs {need:.0%}, "
                        "and every first token)")
    if any(len(o) != args.tokens for o in out):
        problems.append("a prompt stopped early")
    row = [f"TP=1 {device}", backend, dtype, f"{agree}/{total}", f"{elapsed:.2f}",
           "PASS" if not problems else "FAIL: " + "; ".join(problems)]
    return not problems, row, out


def teacher_forced_agreement(checkpoint: Path, dtype: str, prompts: list[list[int]],
                             outputs: list[list[int]], device: str) -> tuple[int, int, bool]:
    """How many of our tokens transformers' argmax reproduces over prompt + ours."""
    import torch
    import transformers

    torch_dtype: Any = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch_dtype).to(device).eval()
    agree = total = 0
    first_ok = True
    with torch.no_grad():
        for prompt, ours in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt + ours], device=device)
            logits = model(ids).logits[0]
            picked = logits[len(prompt) - 1:len(prompt) - 1 + len(ours)].argmax(-1).tolist()
            hits = [a == b for a, b in zip(picked, ours, strict=True)]
            agree += sum(hits)
            total += len(hits)
            first_ok &= bool(hits) and hits[0]
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return agree, total, first_ok


def render(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
