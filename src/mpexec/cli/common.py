"""What the model commands share: argument checks, progress, the default chat prompts."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from mpexec.cli import UsageError


def check_model(model: str) -> None:
    """A path that does not exist is a mistake worth one line, before anything starts."""
    from mpexec.models.fetch import NAMED_MODELS

    if model in NAMED_MODELS:
        return
    if not Path(model).expanduser().exists():
        raise UsageError(f"no such model: {model} (give a checkpoint directory, "
                         f"a .gguf file, or a named model: {', '.join(NAMED_MODELS)})")


def check_is_model(model: str) -> None:
    """A path that exists but holds no model is the user's mistake too (exit status 2)."""
    if model == "default":
        return
    from mpexec.models.fetch import ModelFetchError, check_local_model

    try:
        check_local_model(Path(model).expanduser())
    except ModelFetchError as exc:
        raise UsageError(str(exc)) from None


def check_layout(tp: int, pp: int, nnodes: int = 1, device: str = "auto",
                 dp: int = 1) -> None:
    """This node's share of DP x TP x PP on CUDA needs one visible device per worker.

    CPU workers are not limited by the CPUs: more workers than CPUs run,
    one intra-op thread each (the LLM says so in a WARNING).
    """
    from mpexec.engine.llm import cuda_available

    local = dp * tp * pp // nnodes
    what = f"--tp {tp} x --pp {pp} = {tp * pp}"
    if dp > 1:
        what = f"--data-parallel-size {dp} x --tp {tp} x --pp {pp} = {local}"
    if nnodes > 1:
        what += f" / --nnodes {nnodes} = {local}"
    if device != "cpu" and cuda_available():
        import torch

        count = torch.cuda.device_count()
        if local > count:
            raise UsageError(f"{what} workers, but {count} CUDA devices are visible")


def add_run_arguments(parser: argparse.ArgumentParser, *, max_tokens: int,
                      temperature: float, unit: str) -> None:
    """Sampling, executor and model options that ``generate`` and ``chat`` share."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"tokens per {unit} ({max_tokens})")
    parser.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 is greedy ({temperature})")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    parser.add_argument("--backend", choices=("mp", "uni"), default="mp",
                        help="executor: worker processes (mp) or in this process (uni)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule step N+1 while step N runs")
    add_model_arguments(parser)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How the checkpoint is loaded: context length, dtype, quantised weights."""
    from mpexec.cli import _positive_int

    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="context length (default: the checkpoint's)")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--quantization", default="auto", choices=("auto", "none"),
                        help="quantised GGUF weights: kept packed on CPU (auto, the "
                        "default: int4/int8 kernels, faster decode; results rounded to "
                        "bfloat16, so a nearly tied greedy choice may differ) or "
                        "dequantised to --dtype at load (none: tokens equal to "
                        "transformers)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``generate`` and ``serve`` share beyond TP and PP: context
    parallelism, the KV cache's reuse and transfer, devices, CPU placement,
    and the nodes the workers span."""
    from mpexec.cli import _positive_int

    parser.add_argument("--decode-context-parallel-size", "-dcp", type=_positive_int, default=1,
                        help="spread each request's KV cache over this many ranks of each TP "
                        "group (1); needs --tp >= it x the model's KV heads")
    parser.add_argument("--prefill-context-parallel-size", "-pcp", type=_positive_int,
                        default=1, help="split each long step's tokens over this many ranks "
                        "(1); the workers are TP x PP x PCP")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="share the KV of common prompt prefixes (on)")
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='KV connector, e.g. \'{"kv_connector": "CPUOffloadConnector", '
                        '"kv_connector_extra_config": {"disk_path": "/tmp/kv"}}\'')
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument("--speculative-ngram", type=_positive_int, default=None, metavar="K",
                      help="speculative decoding: up to K prompt-lookup (n-gram) draft tokens "
                      "per step, verified in one forward pass (default: off)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='speculative decoding, vLLM\'s fields, e.g. \'{"method": "ngram", '
                      '"num_speculative_tokens": 4, "prompt_lookup_max": 5, '
                      '"prompt_lookup_min": 2}\'')
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the workers run (auto: CUDA when visible, else CPU)")
    parser.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"),
                        default="auto",
                        help="torch.distributed backend (auto: nccl on CUDA, else gloo)")
    parser.add_argument("--cpu-affinity", choices=("auto",), default=None,
                        help="auto: pin each worker to its share of the usable CPUs, "
                             "inside one NUMA node (default: no pinning)")
    add_node_arguments(parser)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nnodes``, ``--node-rank``, ``--master-addr``, ... of a command that leads nodes."""
    from mpexec.cli import _positive_int

    nodes = parser.add_argument_group(
        "several nodes", "this process leads (node 0); run `mpexec node` on every other node")
    nodes.add_argument("--nnodes", type=_positive_int, default=1,
                       help="nodes the workers span (1)")
    nodes.add_argument("--node-rank", type=int, default=0,
                       help="0, the leader (other nodes run `mpexec node`)")
    nodes.add_argument("--master-addr", default="127.0.0.1",
                       help="this leader's address, reachable from every node (127.0.0.1)")
    nodes.add_argument("--master-port", type=int, default=None,
                       help="the port the followers dial (needed with --nnodes > 1)")
    nodes.add_argument("--secret-file", type=Path, default=None,
                       help="file holding the cluster secret (else MPEXEC_CLUSTER_SECRET)")
    nodes.add_argument("--curve", action="store_true", default=None,
                       help="encrypt the traffic between nodes (ZeroMQ CURVE; else "
                       "MPEXEC_CLUSTER_CURVE); every follower needs it too")


def read_secret(secret_file: Path | None) -> str | None:
    """The cluster secret: ``--secret-file`` if given, else ``MPEXEC_CLUSTER_SECRET``."""
    if secret_file is not None:
        try:
            return secret_file.read_text().strip() or None
        except OSError as exc:
            raise UsageError(f"cannot read --secret-file: {exc}") from exc
    from mpexec.envs import load_envs

    return load_envs().cluster_secret


def follower_command(nnodes: int, node_rank: int | str, master_addr: str,
                     master_port: int | None, dp: int = 1) -> str:
    """What to run on follower ``node_rank`` of a leader at ``master_addr:master_port``.

    With ``dp`` data parallel replicas each replica's nodes dial ``master_port
    + its DP rank``; a node that runs several replicas runs one ``mpexec node``
    per replica.
    """
    head = f"MPEXEC_CLUSTER_SECRET=... mpexec node --nnodes {nnodes} --node-rank {node_rank} " \
        f"--master-addr {master_addr} --master-port"
    if master_port is None:
        return f"{head} PORT" + ("" if dp == 1 else " (+ its data parallel rank)")
    if not isinstance(node_rank, int) or dp == 1:
        return f"{head} {master_port}" + (
            "" if dp == 1 else " (+ the node's data parallel rank)")
    if nnodes >= dp:
        return f"{head} {master_port + node_rank // (nnodes // dp)}"
    per_node = dp // nnodes
    first = master_port + node_rank * per_node
    return " ; ".join(f"{head} {port}" for port in range(first, first + per_node))


def require_torch(command: str) -> None:
    if importlib.util.find_spec("torch") is None:
        raise UsageError(f"'{command}' runs a model and needs torch: "
                         ".venv/bin/pip install -e '.[model]'")


class Progress:
    """One self-rewriting status line on a terminal; silent otherwise."""

    def __init__(self, out: TextIO | None = None, enabled: bool | None = None) -> None:
        self.out = out or sys.stderr
        self.enabled = self.out.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        self.out.write(f"\r\x1b[K{text}")
        self.out.flush()
        self._shown = True

    def done(self) -> None:
        if self.enabled and self._shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = False


DEMO_CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for writing clear code."}],
    [{"role": "user", "content": "Explain in two sentences what a shared-memory ring buffer is."}],
    [{"role": "user", "content": "Write a haiku about parallel computing."}],
]


def speculative_config(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """``--speculative-ngram K`` or ``--speculative-config JSON`` as LLM's
    ``speculative_config`` (None: off)."""
    k = getattr(args, "speculative_ngram", None)
    if k is not None:
        return {"method": "ngram", "num_speculative_tokens": k}
    raw: str | None = getattr(args, "speculative_config", None)
    return raw
