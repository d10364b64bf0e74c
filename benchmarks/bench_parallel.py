"""Data-parallel replicas, mixture-of-experts layouts and replica failover.

Prints three tables from one run::

    python benchmarks/bench_parallel.py [--model default] [--requests 64] [--prompt-len 128]
                                        [--max-tokens 64] [--data-parallel-size 2]
                                        [--threads 1] [--async-scheduling]
                                        [--quantization auto|none] [--moe-batch 1,8]
                                        [--moe-repeats 2] [--moe-tokens 32]
                                        [--moe-format safetensors,gguf-q8_0,gguf-q4_k]
                                        [--parts dense,moe,failover]

1. dense (the default model, SmolLM2-135M): output tokens/s of ``--requests``
   requests (``--prompt-len`` prompt tokens, ``--max-tokens`` output tokens,
   EOS ignored) arriving at once, on TP=1, TP=2 and DP=N x TP=1, one
   intra-op thread per worker; target DP=2 >= 1.7x TP=1 (each replica needs
   a core of its own: on a loaded or small machine it cannot get there).
   A second table says where the CPU went in the same runs: the driver's
   CPU per replica step (this process schedules every replica), each
   worker's CPU, and the "bound": tokens / the busiest worker's CPU
   seconds, the rate the layout would reach with a core per worker and a
   free driver.  ``--quantization`` picks the weights (``auto``: packed,
   LLM's default; ``none``: float32).  Packed, the kernel is compute-bound, its
   cost grows with the rows, so a replica with half the
   rows costs half and DP's bound nears 2x; float32 matmuls stream the
   weights once per step, cost more per row at 32 rows than at 64, and
   DP's bound falls short of 2x (docs/engine.md);
2. mixture of experts: a Mixtral built here with transformers (8 experts,
   top-2, hidden 512, 4 layers, random float32 weights) - tokens/s of a
   batch of each ``--moe-batch`` size (32-token prompts, ``--moe-tokens``
   new tokens) on mpexec TP=1 against transformers' ``generate`` in this
   process with the same thread count (target >= 1.2x), best of
   ``--moe-repeats`` runs taken alternately, and TP=2 against EP=2 (experts
   split whole across the two ranks), with each engine's CPU seconds
   (mpexec: driver and workers together), which other load disturbs less
   than its wall time.  At batch 8 about 7 of the 8 experts are hit every
   step, so both engines read nearly all 192 MB of expert weights per step
   (memory bound on one core); at batch 1 two experts per layer.
   ``--moe-format`` (comma-separated, one table each) picks the checkpoint:
   ``safetensors`` (the default: the float32 weights, both engines alike),
   or ``gguf-q8_0`` / ``gguf-q4_0`` / ``gguf-q4_k``: the same model
   converted to GGUF the way llama.cpp does, every weight but the norms
   and routers quantised; mpexec runs the file with its weights packed
   (``quantization=auto``: the experts' 192 MB become ~60 MB at Q8_0,
   ~30 MB at 4 bits), transformers the same file's values dequantised to
   float32 (written back into the safetensors checkpoint:
   ``testing_gguf.dequantized_checkpoint``), as the dense SmolLM2 and
   Gemma figures compare a packed GGUF with transformers on its values;
3. failover: DP=2 with ``replica_restart``; one replica's worker is SIGKILLed
   (dead), then in a second run SIGSTOPped (hung: the executor's stall watch
   kills it after ``worker_stopped_timeout_s``), when a quarter of the tokens
   are out: seconds from the signal to the rebuilt replica taking work and
   the timeline between (``failover.timeline``), requests lost (outputs that
   differ from an undisturbed run; target 0), and the wall time against the
   undisturbed run.

The load average is printed with each table: the numbers depend on the
machine and what else runs on it; compare within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from harness import proc_cpu_s, render  # noqa: E402

from mpexec.engine.llm import LLM  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(length)]}
            for _ in range(n)]


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def timed(llm: LLM, batch: list[dict[str, Any]], params: SamplingParams,
          progress: Any = None) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    outputs = llm.generate(batch, params, progress=progress)
    return time.perf_counter() - started, outputs


def worker_pids(llm: LLM) -> list[int]:
    """The model workers' pids, replica by replica."""
    engine = llm.engine
    replicas = getattr(engine, "replicas", [engine])
    return [w.proc.pid for replica in replicas for w in replica.executor.workers]


class CpuWindow:
    """CPU seconds of this process (the driver) and of each worker over a window."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.driver = time.process_time()
        self.workers = [proc_cpu_s(pid) for pid in pids]

    def stop(self) -> tuple[float, list[float]]:
        return (time.process_time() - self.driver,
                [proc_cpu_s(pid) - start for pid, start in zip(self.pids, self.workers,
                                                                 strict=True)])


def dense(args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.requests, args.prompt_len, 20000)
    rows, cpu_rows, base, cpu_base = [], [], None, None
    for name, tp, dp in (("TP=1", 1, 1), ("TP=2", 2, 1),
                         (f"DP={args.data_parallel_size} x TP=1", 1, args.data_parallel_size)):
        before = load()
        # The same requests, warm-up, mp executor and threads per worker in
        # every layout; only the layout differs.
        with LLM(args.model, tensor_parallel_size=tp, data_parallel_size=dp,
                 num_threads=args.threads, max_num_seqs=max(64, args.requests),
                 async_scheduling=args.async_scheduling, quantization=args.quantization,
                 max_model_len=args.prompt_len + args.max_tokens + 16) as llm:
            timed(llm, batch[:2], SamplingParams(max_tokens=4))  # warm-up
            steps = llm.engine.stats.steps
            window = CpuWindow(worker_pids(llm))
            seconds, outputs = timed(llm, batch, params)
            driver_s, workers_s = window.stop()
            steps = llm.engine.stats.steps - steps  # replica steps, summed over replicas
        tokens = sum(len(o.token_ids) for o in outputs)
        tok_s = tokens / seconds
        base = base or tok_s
        rows.append([name, f"{tok_s:.1f}", f"{tok_s / base:.2f}x", f"{seconds:.1f}", before])
        # Each worker on a core of its own and the driver free: the rate the
        # busiest worker's CPU time allows (what the layout could reach here).
        bound = tokens / max(workers_s)
        cpu_base = cpu_base or bound
        cpu_rows.append([name, str(steps), f"{1000 * driver_s / steps:.1f}",
                         f"{1000 * sum(workers_s) / steps:.0f}",
                         " + ".join(f"{w:.1f}" for w in workers_s), f"{driver_s:.1f}",
                         f"{bound:.1f}", f"{bound / cpu_base:.2f}x"])
        print(f"# dense {name} done", file=sys.stderr, flush=True)
    print(render(f"1. dense {args.model}: {args.requests} requests x {args.prompt_len} prompt "
                 f"x {args.max_tokens} output tokens, weights "
                 f"{'packed (quantization=auto)' if args.quantization == 'auto' else 'float32'}, "
                 f"{args.threads} thread(s) per worker"
                 f"{', async scheduling' if args.async_scheduling else ''} "
                 "(target DP=2 >= 1.7x TP=1)",
                 ["layout", "output tok/s", "vs TP=1", "seconds", "load avg before"], rows))
    print(render("   where the CPU went in the same runs (driver: this process, which "
                 "schedules every replica; bound: tokens / the busiest worker's CPU s)",
                 ["layout", "replica steps", "driver CPU ms/step", "worker CPU ms/step",
                  "worker CPU s", "driver CPU s", "bound tok/s", "bound vs TP=1"],
                 cpu_rows))
    print()


MOE_FORMATS = ("safetensors", "gguf-q8_0", "gguf-q4_0", "gguf-q4_k")


def build_moe(directory: Path) -> Path:
    import torch
    import transformers

    from mpexec.models import testing

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
    transformers.MixtralForCausalLM(config).save_pretrained(directory)
    testing._write_tokenizer(directory, 1024, False)
    return directory


def moe_checkpoint(hf_dir: Path, fmt: str, directory: Path) -> tuple[Path, Path]:
    """``(what mpexec loads, what transformers loads)`` for ``--moe-format fmt``:
    the safetensors checkpoint for both, or a quantised GGUF of it and the
    same values dequantised back into safetensors."""
    if fmt == "safetensors":
        return hf_dir, hf_dir
    from mpexec.models.testing_gguf import dequantized_checkpoint, quantize_gguf, write_moe_gguf

    qtype = fmt.removeprefix("gguf-").upper()
    plain = directory / "mixtral-f32.gguf"
    if not plain.exists():
        write_moe_gguf(plain, hf_dir)
    path = quantize_gguf(plain, directory / f"mixtral-{qtype}.gguf", qtype, tokenizer=hf_dir)
    return path, dequantized_checkpoint(path, hf_dir, directory / f"mixtral-{qtype}-hf")


def moe(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_moe(Path(tmp) / "mixtral")
        for fmt in args.moe_format.split(","):
            if fmt not in MOE_FORMATS:
                raise SystemExit(f"--moe-format: {fmt!r} is not one of {', '.join(MOE_FORMATS)}")
            moe_table(args, fmt, *moe_checkpoint(hf_dir, fmt, Path(tmp)), tokenizer=hf_dir)


def moe_table(args: argparse.Namespace, fmt: str, path: Path, hf_path: Path, *,
              tokenizer: Path) -> None:
    import torch
    import transformers

    new = args.moe_tokens
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    sizes = [int(size) for size in args.moe_batch.split(",")]
    batches = {size: prompts(size, 32, 1024, seed=1) for size in sizes}
    torch.set_num_threads(args.threads)
    # best of --moe-repeats, mpexec TP=1 and transformers alternating, so
    # that the load of a shared machine weighs on both alike
    # and the CPU of the prefill alone (one new token) for the decode-only figure
    best: dict[tuple[str, int], tuple[float, float, str]] = {}
    prefill: dict[tuple[str, int], float] = {}
    results: dict[tuple[str, int], list[list[int]]] = {}

    def keep(key: tuple[str, int], seconds: float, cpu_s: float, before: str) -> None:
        if key not in best or cpu_s < best[key][1]:
            best[key] = (seconds, cpu_s, before)

    def hf_run(model: Any, size: int, tokens: int) -> tuple[float, float, list[list[int]]]:
        ids = torch.tensor([p["prompt_token_ids"] for p in batches[size]])
        with torch.no_grad():
            started, cpu_started = time.perf_counter(), time.process_time()
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            seconds = time.perf_counter() - started
            cpu_s = time.process_time() - cpu_started
        return seconds, cpu_s, out[:, ids.shape[1]:].tolist()

    def hf(model: Any, size: int) -> None:
        before = load()
        seconds, cpu_s, tokens = hf_run(model, size, new)
        keep(("transformers", size), seconds, cpu_s, before)
        results[("transformers", size)] = tokens
        cpu_s = hf_run(model, size, 1)[1]
        prefill[("transformers", size)] = min(cpu_s, prefill.get(("transformers", size), cpu_s))

    def mpexec_prefill(llm: LLM, key: tuple[str, int]) -> None:
        window = CpuWindow(worker_pids(llm))
        timed(llm, batches[key[1]], SamplingParams(temperature=0, max_tokens=1))
        driver_s, workers_s = window.stop()
        cpu_s = driver_s + sum(workers_s)
        prefill[key] = min(cpu_s, prefill.get(key, cpu_s))

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        model.generate(torch.tensor([batches[sizes[0]][0]["prompt_token_ids"]]),
                       max_new_tokens=2, do_sample=False)  # warm-up
    for name, tp, ep in (("mpexec TP=1", 1, False), ("mpexec TP=2", 2, False),
                         ("mpexec EP=2", 2, True)):
        with LLM(str(path), tokenizer=str(tokenizer), tensor_parallel_size=tp,
                 enable_expert_parallel=ep, num_threads=args.threads, max_model_len=256,
                 quantization="auto") as llm:
            timed(llm, batches[sizes[0]][:1], SamplingParams(max_tokens=2))  # warm-up
            for size in sizes:
                for _ in range(args.moe_repeats if tp == 1 else 1):
                    before = load()
                    window = CpuWindow(worker_pids(llm))
                    seconds, outputs = timed(llm, batches[size], params)
                    driver_s, workers_s = window.stop()
                    keep((name, size), seconds, driver_s + sum(workers_s), before)
                    results[(name, size)] = [o.token_ids for o in outputs]
                    mpexec_prefill(llm, (name, size))
                    if tp == 1:
                        hf(model, size)
        print(f"# moe {fmt} {name} done", file=sys.stderr, flush=True)
    rows: list[list[str]] = []
    for size in sizes:
        hf_seconds, hf_cpu, _ = best[("transformers", size)]
        hf_decode = (hf_cpu - prefill[("transformers", size)]) / (new - 1)
        for name in ("mpexec TP=1", "transformers", "mpexec TP=2", "mpexec EP=2"):
            seconds, cpu_s, before = best[(name, size)]
            tokens = size * new
            decode = (cpu_s - prefill[(name, size)]) / (new - 1)  # CPU s per decode step
            versus = (f"{hf_seconds / seconds:.2f}x / {hf_cpu / cpu_s:.2f}x / "
                      f"{hf_decode / decode:.2f}x" if name == "mpexec TP=1" else "")
            rows.append([str(size), name, f"{tokens / seconds:.1f}", f"{seconds:.2f}",
                         f"{cpu_s:.2f}", f"{tokens / cpu_s:.1f}",
                         f"{1000 * prefill[(name, size)]:.0f}", f"{1000 * decode:.1f}",
                         f"{size / decode:.1f}", versus, before])
    weights = ("float32 safetensors" if fmt == "safetensors" else
               f"{fmt}: mpexec packed, transformers the values dequantised to float32")
    print(render(f"2. MoE (Mixtral 8 experts top-2, hidden 512, 4 layers, random; {weights}): "
                 f"batch x 32 prompt x {new} new tokens, {args.threads} thread(s) per worker "
                 f"and for transformers, best of {args.moe_repeats} alternating runs for TP=1 "
                 "and transformers (target mpexec TP=1 >= 1.2x transformers; CPU s: driver "
                 "and workers together)",
                 ["batch", "engine", "tok/s", "seconds", "CPU s", "tok per CPU s",
                  "prefill CPU ms", "decode CPU ms/step", "decode tok per CPU s",
                  "TP=1 vs transformers (wall / CPU / decode CPU)", "load avg before"], rows))
    for size in sizes:
        base = results[("mpexec TP=1", size)]
        same = all(results[(n, size)] == base for n in ("mpexec TP=2", "mpexec EP=2"))
        theirs = results[("transformers", size)]
        agree = sum(a == b for a, b in zip(base, theirs, strict=True))
        common = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                  for a, b in zip(base, theirs, strict=True)]
        print(f"# {fmt} batch {size}: greedy tokens of TP=2 and EP=2 equal TP=1: {same}; TP=1 "
              f"equals transformers on {agree}/{size} requests (the same first "
              f"{min(common)}-{max(common)} tokens of {new})")
    if fmt != "safetensors":
        print("# packed weights move this random model's logits (about 1.6 at most) by up to "
              "~0.2 (bfloat16 kernels and scales), and its top two logits are often closer "
              "than that (median gap ~0.05-0.13): greedy paths part after a while; "
              "tests/models/test_moe_packed.py bounds the logits against transformers")
    print()


def failover_run(args: argparse.Namespace, signame: str, batch: list[dict[str, Any]],
                 params: SamplingParams) -> tuple[list[str], list[str], list[str]]:
    """One DP=2 run with DP rank 1's worker signalled: (row, timeline row, events)."""
    signum = getattr(signal, signame)
    total = len(batch) * args.max_tokens
    with LLM(args.model, data_parallel_size=2, replica_restart=True, num_threads=args.threads,
             quantization=args.quantization,
             max_model_len=args.prompt_len + args.max_tokens + 16) as llm:
        timed(llm, batch[:2], SamplingParams(max_tokens=4))
        clean_s, clean = timed(llm, batch, params)
        hit_at: list[float] = []

        def hit(finished: int, count: int, tokens: int) -> None:
            if not hit_at and tokens >= total // 4:
                os.kill(llm.engine.replicas[1].executor.workers[0].proc.pid, signum)
                hit_at.append(time.monotonic())

        before = load()
        hit_s, hurt = timed(llm, batch, params, progress=hit)
        deadline = time.monotonic() + 120
        while not llm.engine.failover.restarts and time.monotonic() < deadline:
            time.sleep(0.1)  # the rebuild may outlast the generate call
        stats = llm.engine.failover
    lost = sum(a.token_ids != b.token_ids for a, b in zip(clean, hurt, strict=True))
    first = {phase: at for at, _, phase in reversed(stats.timeline)}
    since = hit_at[0] if hit_at else 0.0
    phases = [signame] + [f"{first[p] - since:.1f}" if p in first else "-"
                          for p in ("failed", "rebuilding", "serving")]
    row = [signame, str(len(batch)), f"{clean_s:.1f}", f"{hit_s:.1f}",
           f"{hit_s / clean_s:.2f}x", str(stats.requeued_requests), phases[-1], str(lost),
           before]
    return row, phases, [f"{signame}: {event}" for event in stats.events]


def failover(args: argparse.Namespace) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = prompts(args.failover_requests, args.prompt_len, 20000, seed=2)
    total = len(batch) * args.max_tokens
    rows, phases, events = [], [], []
    for signame in args.failover_signals.split(","):
        row, phase, said = failover_run(args, signame, batch, params)
        rows.append(row)
        phases.append(phase)
        events += said
        print(f"# failover {signame} done", file=sys.stderr, flush=True)
    print(render(f"3. failover: DP=2, replica_restart, DP rank 1's worker signalled after "
                 f"{total // 4} of {total} tokens (target: 0 lost)",
                 ["signal", "requests", "undisturbed s", "with failure s", "slowdown",
                  "re-queued", "signal -> serving again s", "lost", "load avg before"], rows))
    print(render("   timeline, seconds after the signal (failed: the front end saw it; "
                 "rebuilding: the new replica started; serving: it takes work)",
                 ["signal", "failed", "rebuilding", "serving"], phases))
    for event in events:
        print(f"# {event}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads per worker (1: the layouts compare fairly)")
    parser.add_argument("--quantization", choices=("auto", "none"), default="auto",
                        help="dense and failover parts: the GGUF's weights packed (auto, LLM's "
                             "default) or dequantised to float32 (none)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="dense part: every layout schedules its next step while the "
                             "current one runs")
    parser.add_argument("--moe-batch", default="1,8",
                        help="MoE part: comma-separated batch sizes, one table row group each")
    parser.add_argument("--moe-repeats", type=int, default=2,
                        help="MoE part: alternating runs of mpexec TP=1 and transformers "
                             "per batch size; the table shows the best of each")
    parser.add_argument("--moe-tokens", type=int, default=32)
    parser.add_argument("--moe-format", default="safetensors",
                        help="MoE part: comma-separated checkpoints, one table each: "
                             "safetensors (float32), gguf-q8_0, gguf-q4_0, gguf-q4_k "
                             "(mpexec packed, transformers the same values in float32)")
    parser.add_argument("--failover-requests", type=int, default=16)
    parser.add_argument("--failover-signals", default="SIGKILL,SIGSTOP",
                        help="a worker killed (SIGKILL) or hung (SIGSTOP), one run each")
    parser.add_argument("--parts", default="dense,moe,failover")
    args = parser.parse_args()
    print(f"# {os.cpu_count()} CPUs, load average {load()}")
    parts = args.parts.split(",")
    if "dense" in parts:
        dense(args)
    if "moe" in parts:
        moe(args)
    if "failover" in parts:
        failover(args)


if __name__ == "__main__":
    main()
