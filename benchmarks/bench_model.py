"""Model benchmarks: the ModelWorker on a GGUF model beside transformers, one table.

    python benchmarks/bench_model.py [--model default|gemma3-270m|PATH] [--steps 24] [--threads 1]
                                     [--dtypes float32,bfloat16] [--layouts tp1,tp2,pp2]
                                     [--quantizations auto,none] [--prompt text|synthetic]
                                     [--profile]

For each dtype, quantisation (``auto``: quantised weights kept packed,
``none``: dequantised to the dtype) and layout (TP=1, TP=2, PP=2 through the mp executor, one
worker process per rank with ``--threads`` intra-op threads each) and for
transformers (``generate`` on the same GGUF, same dtype, same threads, in
this process), in the same run:

- load time: for mpexec, starting the executor until its KV cache is up and
  warmed (processes, checkpoint, weights); for transformers, ``from_pretrained``
  of the GGUF (float32);
- decode tokens/s at batch 1 and 16 (64-token prompts, greedy; the median
  step: for transformers, between consecutive calls of a logits processor in
  generate).  A greedy step of a packed 8-bit head reads half the head and
  re-scores the logits that could win (``embedding.ParallelLMHead``), so
  its cost depends on how flat the distribution is: ``--prompt text``
  (English, the default) or ``synthetic`` (arithmetic token ids, flat at
  first);
- prefill tokens/s of one 512-token prompt;
- weight bytes read per second in batch-1 decode (every weight of a rank is
  read once per step) beside a streaming-read bandwidth (``sum`` over 512 MiB,
  1 and 2 threads) measured here too;
- the executor's share of a decode step: driver wall time of execute_model +
  sample_tokens minus the output rank's ``worker_execute_s`` +
  ``worker_sample_s``, over the wall time;
- resident memory per worker (VmRSS) and the weight bytes it holds, and
  those weight bytes (what a batch-1 decode step reads) packed against float32;
- the bytes each rank reads from the file when loading packed at TP=2
  (in this process, one rank after the other);
- with ``--profile``, where a batch-1 decode step spends its time on each
  rank (cProfile around execute_model and sample_tokens only, in a separate
  run of ``--steps`` steps whose rates are not reported): waiting in a
  collective for the other TP ranks to arrive, the rest of the collectives,
  matmuls, the attention kernel, other torch ops, and the Python around them.

Numbers depend on the machine and its load (printed with the CPU model at
the start and the end); compare within one run.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from harness import percentile, render  # noqa: E402

from mpexec import Executor, ExecutorConfig, ParallelConfig  # noqa: E402
from mpexec.outputs import (  # noqa: E402
    PLACEHOLDER_TOKEN_ID,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

BLOCK = 16
PROMPT = 64
# English text for the decode prompts (``--prompt text``): request i of a batch
# starts 7·i tokens in, so no two requests share a prompt.
PASSAGE = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk, carrying a "
    "small brass lamp and a notebook in which he wrote down the weather, the ships he "
    "had seen and anything else that seemed worth remembering. Over the years the "
    "notebook had grown into a shelf of notebooks, and the shelf into a small library "
    "that visitors from the village sometimes asked to read. They found storms described "
    "in careful detail, the names of fishing boats that no longer sailed, recipes for "
    "fish soup, arguments with himself about the stars, and long lists of birds that "
    "rested on the gallery rail during the autumn migration. One winter a young woman "
    "from the university came to copy the weather records for a study of the coast. "
    "She stayed for three weeks, and when she left she asked whether she might come back "
    "in the spring to read the rest. He said that she could, and then, after a pause, "
    "that he would be glad of the company, which surprised them both. In April she "
    "returned with a camera, a box of pencils and a great many questions about tides.")


def decode_prompts(model: Path, kind: str, batch: int) -> list[list[int]]:
    """The ``PROMPT``-token prompts of a decode batch: windows of ``PASSAGE``
    (``text``) or arithmetic token ids (``synthetic``: 100, 103, 106, …, the
    benchmark's prompt before 2026-12-05, which sends Gemma 3 into near-flat
    distributions for its first steps)."""
    if kind == "synthetic":
        return [[(13 * i + 3 * j) % 40000 + 100 for j in range(PROMPT)] for i in range(batch)]
    from mpexec.models.loader import open_checkpoint

    with open_checkpoint(model) as checkpoint:
        tokens = checkpoint.tokenizer().encode(PASSAGE)
    if len(tokens) < PROMPT + 7 * (batch - 1):
        raise ValueError(f"the passage has {len(tokens)} tokens: too few for {batch} prompts")
    return [tokens[7 * i: 7 * i + PROMPT] for i in range(batch)]
PREFILL = 512
GREEDY = SamplingParams(temperature=0, max_tokens=10_000)


def worker_rss(wrapper: Any) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_weight_bytes(wrapper: Any) -> int:
    """Bytes of the distinct weight tensors this rank holds (= read per decode step,
    except the embedding rows that only the LM head reads when tied)."""
    stage = wrapper.worker.stage
    seen: dict[int, int] = {}

    def visit(obj: Any, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            seen[obj.data_ptr()] = obj.numel() * obj.element_size()
        elif depth < 6 and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                if name == "group":
                    continue  # a process group's buffers
                if isinstance(value, list):
                    for item in value:
                        visit(item, depth + 1)
                else:
                    visit(value, depth + 1)

    visit(stage)
    rotary = stage.rotary
    for table in (rotary.cos, rotary.sin):  # tables, not weights
        seen.pop(table.data_ptr(), None)
    if stage.embedding is not None:  # one row per token only, unless the head shares it
        head = stage.lm_head.weight if stage.lm_head is not None else None
        for tensor in _tensors(stage.embedding.weight):
            if not any(tensor.data_ptr() == t.data_ptr() for t in _tensors(head)):
                seen.pop(tensor.data_ptr(), None)
    return sum(seen.values())


def _tensors(weight: Any) -> list[torch.Tensor]:
    """The tensors of a float or packed weight (None: none)."""
    if weight is None:
        return []
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [t for t in vars(weight).values() if isinstance(t, torch.Tensor)]


def worker_profile_start(wrapper: Any) -> None:
    """Profile this worker's execute_model and sample_tokens (nothing between calls)."""
    import cProfile
    import functools

    worker = wrapper.worker
    worker.bench_profile = cProfile.Profile()
    for name in ("execute_model", "sample_tokens"):
        setattr(worker, name, functools.partial(worker.bench_profile.runcall,
                                                getattr(worker, name)))


def worker_profile_report(wrapper: Any) -> dict[str, float]:
    """Stop the profile; seconds spent, by where they went.

    The TP collectives (``GroupCoordinator.all_reduce`` / ``all_gather``) count
    whole, split into the wait for the other ranks to arrive
    (``_wait_for_peers``) and the rest (copies in and out of shared memory,
    the sum); every other second is the own time of a matmul, the attention
    kernel, another torch op, or Python."""
    import pstats

    worker = wrapper.worker
    del worker.execute_model, worker.sample_tokens  # the class's methods again
    stats: dict[Any, Any] = pstats.Stats(worker.bench_profile).stats  # type: ignore[attr-defined]
    out = dict.fromkeys(PROFILE_PARTS, 0.0)
    for (file, _line, function), (_cc, _nc, own_s, inclusive_s, callers) in stats.items():
        out["total"] += own_s
        if function == "_wait_for_peers":
            out["waiting for TP peers"] += inclusive_s
        elif function in ("all_reduce", "all_gather") and file.endswith("distributed/group.py"):
            out["TP collectives besides waiting"] += inclusive_s
        elif "torch._C._nn.linear" in function:
            out["matmul (F.linear)"] += own_s
        elif "scaled_dot_product_attention" in function:
            out["attention kernel (SDPA)"] += own_s
        elif "torch" in function:  # a torch op: count what was not called by a collective
            out["other torch ops"] += sum(
                timing[2] for (caller_file, *_), timing in callers.items()
                if "/mpexec/distributed/" not in caller_file)
    out["TP collectives besides waiting"] -= out["waiting for TP peers"]
    return out


PROFILE_PARTS = ("waiting for TP peers", "TP collectives besides waiting", "matmul (F.linear)",
                 "attention kernel (SDPA)", "other torch ops", "total")


class OurModel:
    """An mp executor of ModelWorkers, stepped with hand-built SchedulerOutputs."""

    def __init__(self, model: Path, tp: int, pp: int, dtype: str, threads: int,
                 quantization: str, prompts: list[list[int]]) -> None:
        self.prompts = prompts  # one per request of a decode batch
        config = ExecutorConfig(
            worker_cls="mpexec.models.worker:ModelWorker",
            worker_kwargs=dict(model=str(model), dtype=dtype, quantization=quantization,
                               block_size=BLOCK,
                               max_model_len=1024, num_threads=threads,
                               kv_cache_memory_bytes=256 << 20),
            parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
            executor_backend="mp", device_type="cpu", omp_num_threads=threads,
            startup_timeout_s=600.0, execute_model_timeout_s=600.0)
        self.executor = Executor.get_class(config)(config)
        self.pp = pp
        memory = self.executor.collective_rpc("determine_available_memory")
        block_bytes = self.executor.collective_rpc("kv_cache_block_bytes")
        self.num_blocks = min(m // b for m, b in zip(memory, block_bytes, strict=True))
        self.executor.collective_rpc("initialize_cache", args=(self.num_blocks,))
        self.executor.execute_dummy_batch()
        self.next_block = 0
        self.serial = 0
        self.profiles: list[dict[str, float]] = []

    def close(self) -> None:
        self.executor.shutdown()

    def _blocks(self, tokens: int) -> list[int]:
        count = -(-tokens // BLOCK)
        if self.next_block + count > self.num_blocks:
            self.next_block = 0  # old requests are finished: reuse the pool
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def _step(self, output: SchedulerOutput) -> tuple[float, float, Any]:
        started = time.perf_counter()
        self.executor.execute_model(output)
        result = self.executor.sample_tokens(None)
        wall = time.perf_counter() - started
        inside = result.extra["worker_execute_s"] + result.extra["worker_sample_s"]
        return wall, inside, result

    def prefill_rate(self, reps: int = 3) -> float:
        times = []
        for _ in range(reps):
            self.serial += 1
            rid = f"p{self.serial}"
            prompt = [(7 * i) % 40000 + 100 for i in range(PREFILL)]
            new = NewRequestData(rid, prompt, GREEDY, self._blocks(PREFILL + 1))
            wall, _, _ = self._step(SchedulerOutput(
                scheduled_new_reqs=[new], scheduled_tokens={rid: prompt},
                num_computed_tokens={rid: 0}))
            times.append(wall)
            self._step(SchedulerOutput(finished_req_ids={rid}))
        return PREFILL / percentile(times, 50)

    def decode(self, batch: int, steps: int, profile: bool = False) -> tuple[float, float]:
        """(tokens/s over the median step, the executor's share of a step); with
        ``profile``, each rank's breakdown of the decode steps lands in ``profiles``."""
        rids = []
        news = []
        for i in range(batch):
            self.serial += 1
            rid = f"d{self.serial}"
            prompt = self.prompts[i]
            news.append(NewRequestData(rid, prompt, GREEDY, self._blocks(PROMPT + steps + 4)))
            rids.append(rid)
        _, _, result = self._step(SchedulerOutput(
            scheduled_new_reqs=news, scheduled_tokens={n.req_id: n.prompt_token_ids for n in news},
            num_computed_tokens={rid: 0 for rid in rids}))
        last = {rid: tokens[0] for rid, tokens in
                zip(result.req_ids, result.sampled_token_ids, strict=True)}
        walls, shares = [], []
        if profile:
            self.executor.collective_rpc(worker_profile_start)
        for step in range(steps):
            # the protocol allows placeholders only without PP
            tokens = {rid: [PLACEHOLDER_TOKEN_ID if self.pp == 1 else last[rid]] for rid in rids}
            wall, inside, result = self._step(SchedulerOutput(
                scheduled_tokens=tokens, num_computed_tokens={rid: PROMPT + step for rid in rids}))
            last = {rid: t[0] for rid, t in
                    zip(result.req_ids, result.sampled_token_ids, strict=True)}
            walls.append(wall)
            shares.append(max(wall - inside, 0.0) / wall)
        if profile:
            self.profiles = self.executor.collective_rpc(worker_profile_report)
        self._step(SchedulerOutput(finished_req_ids=set(rids)))
        return batch / percentile(walls, 50), percentile(shares, 50)

    def memory(self) -> tuple[list[int], list[int]]:
        return (self.executor.collective_rpc(worker_rss),
                self.executor.collective_rpc(worker_weight_bytes))


class Reference:
    """transformers generate on the same GGUF, in this process."""

    def __init__(self, model: Path, threads: int, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        import transformers

        torch.set_num_threads(threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model.parent, gguf_file=model.name, dtype=torch.float32).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def to(self, dtype: str) -> None:
        self.model.to(getattr(torch, dtype))

    def _generate(self, batch: int, length: int, new: int) -> list[float]:
        """Run generate; the times at which each step's logits were ready
        (a logits processor is called once per step), from the start."""
        import transformers

        stamps: list[float] = []

        class Clock(transformers.LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(self.prompts[:batch] if length == PROMPT else
                           [[(13 * i + 3 * j) % 40000 + 100 for j in range(length)]
                            for i in range(batch)])
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, pad_token_id=0,
                                logits_processor=transformers.LogitsProcessorList([Clock()]))
        return [stamp - started for stamp in stamps]

    def decode_rate(self, batch: int, steps: int) -> float:
        """Tokens/s over the median decode step of generate (steps after the first)."""
        stamps = self._generate(batch, PROMPT, steps + 1)
        steps_s = [b - a for a, b in itertools.pairwise(stamps)]
        return batch / percentile(steps_s, 50)

    def prefill_rate(self) -> float:
        return PREFILL / percentile([self._generate(1, PREFILL, 1)[0] for _ in range(3)], 50)


def stream_bandwidth(threads: int) -> float:
    """Bytes/s of a streaming read (torch sum over 512 MiB of float32)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    data = torch.ones(128 << 20)
    data.sum()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    torch.set_num_threads(previous)
    return data.numel() * 4 / min(times)


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def machine() -> str:
    """The CPU model (lscpu) and the load average: other jobs share this machine."""
    import os
    import subprocess

    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in lines.splitlines()
                      if line.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        model = "?"
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"CPU {model}, {os.cpu_count()} CPUs, load average {load}"


class _LoadOnlyGroup:
    """A TP group for loading one rank in this process (no collective runs)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in_group, self.world_size = rank, size

    def all_reduce(self, tensor: Any) -> Any:
        raise AssertionError("no collective at load")

    def all_gather(self, tensor: Any, dim: int = -1) -> Any:
        raise AssertionError("no collective at load")


def rank_reads(model: Path, tp: int, quantization: str) -> list[int]:
    """Bytes each TP rank reads from the file to load its stage."""
    from mpexec.models.llama import load_stage
    from mpexec.models.loader import open_checkpoint
    from mpexec.models.sharding import rank_share

    reads = []
    for rank in range(tp):
        with open_checkpoint(model) as checkpoint:
            c = checkpoint.config
            share = rank_share(num_heads=c.num_attention_heads,
                               num_kv_heads=c.num_key_value_heads,
                               intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                               layers=(0, c.num_hidden_layers), tp_rank=rank, tp_size=tp)
            load_stage(checkpoint, c, share, is_first=True, is_last=True,
                       tp_group=_LoadOnlyGroup(rank, tp), dtype=torch.float32,
                       device=torch.device("cpu"), max_positions=64,
                       quantization=quantization)
            reads.append(checkpoint.bytes_read)
    return reads


def progress(row: list[Any]) -> None:
    """One measured row on stderr as soon as it exists (a long run keeps what it has)."""
    print("measured:", " | ".join(str(c) for c in row), file=sys.stderr, flush=True)


def profile_rows(label: str, profiles: list[dict[str, float]], steps: int) -> list[list[Any]]:
    rows = []
    for rank, parts in enumerate(profiles):
        total = parts["total"]
        named = [parts[name] for name in PROFILE_PARTS[:-1]]
        cells = [f"{1e3 * v / steps:.1f} ({100 * v / total:.0f}%)"
                 for v in [*named, total - sum(named)]]
        rows.append([label, rank, *cells, f"{1e3 * total / steps:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layouts", default="tp1,tp2,pp2")
    parser.add_argument("--quantizations", default="auto,none")
    parser.add_argument("--read-tp", type=int, default=2,
                        help="also load packed at this TP size here and count each rank's "
                        "file reads (0: skip)")
    parser.add_argument("--prompt", choices=("text", "synthetic"), default="text",
                        help="decode prompts: windows of an English passage, or arithmetic "
                        "token ids (see decode_prompts)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile batch-1 decode steps on every rank")
    args = parser.parse_args()
    from mpexec.models.fetch import resolve_model

    model = resolve_model(args.model)
    dtypes = args.dtypes.split(",")
    layouts = args.layouts.split(",")
    quantizations = args.quantizations.split(",")
    print(f"start: {machine()}", file=sys.stderr, flush=True)
    bandwidth = {n: stream_bandwidth(n) for n in (1, 2)}
    rows: list[list[Any]] = []
    extras: list[list[Any]] = []
    profiles: list[list[Any]] = []
    started = time.perf_counter()
    prompts = decode_prompts(model, args.prompt, 16)
    reference = Reference(model, args.threads, prompts)
    reference_load = time.perf_counter() - started
    measured: dict[tuple[str, str], dict[str, float]] = {}
    for dtype in dtypes:
        reference.to(dtype)
        ref = {"b1": reference.decode_rate(1, args.steps),
               "b16": reference.decode_rate(16, args.steps),
               "prefill": reference.prefill_rate()}
        bytes_per_token = reference.weight_bytes * (2 if dtype != "float32" else 4) // 4
        rows.append([f"transformers {dtype}", f"{reference_load:.1f}", f"{ref['b1']:.1f}",
                     f"{ref['b16']:.1f}",
                     f"{ref['prefill']:.0f}", "1.00x",
                     f"{bytes_per_token * ref['b1'] / 1e9:.2f}", "-"])
        progress(rows[-1])
        for layout, quantization in itertools.product(layouts, quantizations):
            tp, pp = LAYOUTS[layout]
            started = time.perf_counter()
            ours = OurModel(model, tp, pp, dtype, args.threads, quantization, prompts)
            layout = f"{layout} {'packed' if quantization == 'auto' else 'dequantised'}"
            load = time.perf_counter() - started
            try:
                b1, share1 = ours.decode(1, args.steps)
                b16, share16 = ours.decode(16, args.steps)
                prefill = ours.prefill_rate()
                rss, weights = ours.memory()
                if args.profile:
                    ours.decode(1, args.steps, profile=True)
                    profiles.extend(profile_rows(f"{layout} {dtype}", ours.profiles,
                                                 args.steps))
            finally:
                ours.close()
            measured[(dtype, layout)] = {"b1": b1, "b16": b16, "weights": sum(weights)}
            # batch-1 decode reads each rank's weights once per token; ranks read in
            # parallel (TP) or in turn (PP), so the total is what moves per second
            rows.append([f"mpexec {layout} {dtype}", f"{load:.1f}", f"{b1:.1f}", f"{b16:.1f}",
                         f"{prefill:.0f}",
                         f"{b1 / ref['b1']:.2f}x", f"{sum(weights) * b1 / 1e9:.2f}",
                         f"{100 * share1:.2f}% / {100 * share16:.2f}%"])
            extras.append([f"{layout} {dtype}", " ".join(f"{r / 2**20:.0f}" for r in rss),
                           " ".join(f"{w / 2**20:.0f}" for w in weights)])
            progress(rows[-1] + extras[-1][1:])
    print(render(f"{model.name} decode/prefill, {args.threads} intra-op thread(s) per process "
                 f"(streaming read: {bandwidth[1] / 1e9:.1f} GB/s on 1 thread, "
                 f"{bandwidth[2] / 1e9:.1f} GB/s on 2)",
                 ["engine", "load s", "decode b=1 tok/s", "decode b=16 tok/s", "prefill 512 tok/s",
                  "b=1 vs transformers", "weights GB/s at b=1", "executor share b=1 / b=16"],
                 rows))
    print()
    print(render("resident memory per worker (MiB) and the weights it holds (MiB)",
                 ["layout", "VmRSS per rank", "weights per rank"], extras))
    if profiles:
        print()
        print(render(f"where a batch-1 decode step goes (ms per step, {args.steps} profiled "
                     "steps; cProfile inflates the Python share)",
                     ["layout", "rank", *PROFILE_PARTS[:-1], "Python and the rest", "total"],
                     profiles))
    packing = []
    for dtype, layout in itertools.product(dtypes, layouts):
        packed = measured.get((dtype, f"{layout} packed"))
        dense = measured.get((dtype, f"{layout} dequantised"))
        if packed and dense:
            packing.append([f"{layout} {dtype}", f"{packed['weights'] / 2**20:.1f}",
                            f"{dense['weights'] / 2**20:.1f}",
                            f"{packed['weights'] / dense['weights']:.3f}",
                            f"{packed['b1'] / dense['b1']:.2f}x",
                            f"{packed['b16'] / dense['b16']:.2f}x"])
    if packing:
        print()
        print(render("packed vs dequantised: weight bytes read per decode step (all ranks) "
                     "and decode speed", ["layout", "packed MiB", "dequantised MiB", "ratio",
                                         "b=1 speed-up", "b=16 speed-up"], packing))
    if args.read_tp > 1:
        size = model.stat().st_size
        reads = rank_reads(model, args.read_tp, "auto")
        print()
        print(render(f"bytes each rank reads from the {size:,}-byte file, packed at "
                     f"TP={args.read_tp}", ["rank", "bytes read", "share of the file"],
                     [[rank, f"{n:,}", f"{n / size:.3f}"] for rank, n in enumerate(reads)]))
    scaling = []
    for dtype, quantization in itertools.product(dtypes, ("packed", "dequantised")):
        if (dtype, f"tp1 {quantization}") in measured and \
                (dtype, f"tp2 {quantization}") in measured:
            one = measured[(dtype, f"tp1 {quantization}")]
            two = measured[(dtype, f"tp2 {quantization}")]
            scaling.append([f"{dtype} {quantization}",
                            f"{two['b1'] / one['b1']:.2f}x (target 1.3x)",
                            f"{two['b16'] / one['b16']:.2f}x (target 1.6x)"])
    if scaling:
        print()
        print(render(f"TP=2 vs TP=1 at {args.threads} thread(s) per worker",
                     ["dtype", "batch 1", "batch 16"], scaling))
    print(f"\nmachine at the start: see stderr; at the end: {machine()}")


if __name__ == "__main__":
    main()
