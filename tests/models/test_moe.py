"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE) against transformers.

Tiny random checkpoints written by transformers at test time: 5 experts
(so two expert-parallel ranks hold 3 + 2), top-2, expert rows that split
unevenly at TP=2, and for Qwen2-MoE a shared expert, ``norm_topk_prob`` off
and one dense layer (``mlp_only_layers``).  TP=1 runs in this process and
must give transformers' greedy tokens and logits; TP=2 and EP=2 (experts
split whole across the two ranks) must give TP=1's.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.model_run_driver import StepDriver, make_executor  # noqa: E402

from mpexec.errors import WorkerError  # noqa: E402
from mpexec.models.config import ModelConfig  # noqa: E402
from mpexec.models.moe import expert_share  # noqa: E402
from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.timeout(300)]
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SHAPE = dict(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False, num_experts_per_tok=2, initializer_range=0.1)


def save_random_moe(directory: Path, kind: str, seed: int = 0, **overrides: Any) -> Path:
    torch.manual_seed(seed)
    only = overrides.pop("mlp_only_layers", [1])  # Qwen: the dense layers
    shape = {**SHAPE, **overrides}
    if kind == "mixtral":
        config = transformers.MixtralConfig(**shape, intermediate_size=45, num_local_experts=5)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3_moe":  # Qwen3 attention (q/k norms), no shared expert
        config = transformers.Qwen3MoeConfig(
            **shape, intermediate_size=50, moe_intermediate_size=45, num_experts=5,
            norm_topk_prob=True, mlp_only_layers=only, head_dim=24)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            **shape, intermediate_size=50, moe_intermediate_size=45,
            shared_expert_intermediate_size=37, num_experts=5, norm_topk_prob=False,
            mlp_only_layers=only)
        model = transformers.Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    return directory


def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(0, 101, (4 + 5 * i,), generator=g).tolist()
            for i in range(3)}


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_case(request: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = save_random_moe(tmp_path_factory.mktemp(request.param), request.param)
    with make_executor(path, backend="uni") as executor:
        runs = StepDriver(executor, fetch_logits=True).generate(
            {rid: (p, GREEDY) for rid, p in prompts().items()})
    return {"path": path, "runs": runs, "kind": request.param}


def test_config_reads_the_experts(moe_case: dict[str, Any]) -> None:
    config = ModelConfig.from_hf_dir(moe_case["path"])
    assert config.moe is not None and config.moe.num_experts == 5 and config.moe.top_k == 2
    if moe_case["kind"] == "mixtral":
        assert config.moe.norm_topk_prob and not config.moe.shared_expert_intermediate_size
    elif moe_case["kind"] == "qwen3_moe":
        assert config.features.qk_norm and config.head_dim == 24
        assert config.moe.norm_topk_prob and not config.moe.shared_expert_intermediate_size
        assert [config.moe.is_sparse(i) for i in range(3)] == [True, False, True]
    else:
        assert not config.moe.norm_topk_prob
        assert config.moe.shared_expert_intermediate_size == 37
        assert [config.moe.is_sparse(i) for i in range(3)] == [True, False, True]
    # two EP ranks hold 3 + 2 whole experts; two TP ranks 23 + 22 rows of each
    assert [expert_share(config.moe, r, 2, True).experts for r in (0, 1)] == [(0, 3), (3, 5)]
    assert [expert_share(config.moe, r, 2, False).rows for r in (0, 1)] == [(0, 23), (23, 45)]


def test_tp1_reproduces_transformers(moe_case: dict[str, Any]) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        moe_case["path"], dtype=torch.float32, experts_implementation="eager").eval()
    for rid, prompt in prompts().items():
        run = moe_case["runs"][rid]
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                      min_new_tokens=8)[0, len(prompt):].tolist()
            logits = model(torch.tensor([prompt + run.output])).logits[0]
        assert run.output == expected
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(run.output)]
        torch.testing.assert_close(torch.stack(run.logits), rows, atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_parallel_layouts_reproduce_tp1(moe_case: dict[str, Any], tp: int, pp: int, ep: bool,
                                        leak_check: None) -> None:
    with make_executor(moe_case["path"], tp=tp, pp=pp, ep=ep) as executor:
        runs = StepDriver(executor, fetch_logits=True, chunk=5, placeholders=pp == 1).generate(
            {rid: (p, GREEDY) for rid, p in prompts().items()})
    for rid, run in runs.items():
        reference = moe_case["runs"][rid]
        assert run.output == reference.output
        torch.testing.assert_close(torch.stack(run.logits), torch.stack(reference.logits),
                                   atol=ATOL, rtol=0)


@pytest.fixture(params=["mixtral", "qwen2_moe", "qwen3_moe"])
def gguf_case(request: Any, tmp_path: Path) -> dict[str, Any]:
    """A tiny MoE written by transformers and converted to GGUF the way llama.cpp
    does; transformers' model of it (loaded before the test's leak check: its
    progress bar keeps a semaphore)."""
    pytest.importorskip("gguf")
    from mpexec.models.testing_gguf import write_moe_gguf

    kind = request.param
    hf_dir = save_random_moe(tmp_path / kind, kind, mlp_only_layers=[])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, experts_implementation="eager").eval()
    return {"kind": kind, "path": write_moe_gguf(tmp_path / f"{kind}.gguf", hf_dir),
            "model": model}


def test_gguf_experts_reproduce_transformers(gguf_case: dict[str, Any],
                                             leak_check: None) -> None:
    """The GGUF's stacked ffn_*_exps, ffn_gate_inp and Qwen2-MoE's shexp tensors
    give transformers' logits, in one process (Mixtral, Qwen3-MoE) and with the
    experts split over two ranks (EP=2, Qwen2-MoE: 3 + 2 experts, each rank
    reading its experts at their offsets in the stacked tensors)."""
    layout: dict[str, Any] = {"tp": 2, "ep": True} if gguf_case["kind"] == "qwen2_moe" else \
        {"backend": "uni"}
    with make_executor(gguf_case["path"], **layout) as executor:
        runs = StepDriver(executor, fetch_logits=True).generate(
            {rid: (p, GREEDY) for rid, p in prompts().items()})
    for rid, prompt in prompts().items():
        run = runs[rid]
        with torch.no_grad():
            logits = gguf_case["model"](torch.tensor([prompt + run.output])).logits[0]
        rows = logits[len(prompt) - 1:len(prompt) - 1 + len(run.output)]
        assert run.output == rows.argmax(-1).tolist()
        torch.testing.assert_close(torch.stack(run.logits), rows, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def moe_with_tokenizer(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mixtral with the tiny checkpoint's vocabulary and tokenizer (for LLM)."""
    path = save_random_moe(tmp_path_factory.mktemp("moe-tok"), "mixtral", vocab_size=389)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, path / name)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "mixtral"])
def test_two_data_parallel_replicas_match_one(kind: str, tiny_checkpoint: Path,
                                              moe_with_tokenizer: Path,
                                              leak_check: None) -> None:
    from mpexec.engine.llm import LLM

    path = tiny_checkpoint if kind == "dense" else moe_with_tokenizer
    g = torch.Generator().manual_seed(5)
    prompts_ = [{"prompt_token_ids": torch.randint(4, 389, (3 + 2 * i,), generator=g).tolist()}
                for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)] * 3
    results = []
    for dp in (1, 2):
        with LLM(str(path), data_parallel_size=dp, num_threads=1, block_size=4,
                 kv_cache_memory_bytes=16 << 20, shutdown_grace_s=5.0) as llm:
            results.append([o.token_ids for o in llm.generate(prompts_, params)])
    assert results[0] == results[1]


def _dp_and_ep_groups(wrapper: Any) -> tuple[int, int, int, int]:
    from mpexec import distributed

    dp, ep = distributed.get_dp_group(), distributed.get_ep_group()
    return dp.rank_in_group, dp.world_size, ep.rank_in_group, ep.world_size


def _set_dispatch(wrapper: Any, dispatch: str) -> list[str]:
    """Every MoE block of this worker dispatches its tokens this way; their ways before."""
    blocks = [layer.moe for layer in wrapper.worker.stage.layers if layer.moe is not None]
    before = [block.dispatch for block in blocks]
    for block in blocks:
        block.dispatch = dispatch
    return before


def one_replica_then_split(path: Path, before: Any = None, after: Any = None,
                           **llm_kwargs: Any) -> list[list[list[int]]]:
    """Greedy tokens of 5 requests of uneven lengths on one replica, then on
    DP=2 x TP=1 with EP (the replicas in lockstep: one runs out of work first
    and idles in dummy steps); ``before(llm)`` / ``after(llm)`` run around the
    split run's generate."""
    from mpexec.engine.llm import LLM

    g = torch.Generator().manual_seed(8)
    prompts_ = [{"prompt_token_ids": torch.randint(4, 389, (3 + 3 * i,), generator=g).tolist()}
                for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 3 * i, ignore_eos=True)
              for i in range(5)]
    results = []
    for dp, ep in ((1, False), (2, True)):
        with LLM(str(path), data_parallel_size=dp, enable_expert_parallel=ep,
                 num_threads=1, block_size=4, kv_cache_memory_bytes=16 << 20,
                 shutdown_grace_s=5.0, **llm_kwargs) as llm:
            if ep and before is not None:
                before(llm)
            results.append([o.token_ids for o in llm.generate(prompts_, params)])
            if ep:
                assert llm.engine.lockstep and llm.engine.dummy_steps > 0
                if after is not None:
                    after(llm)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_gather"])
def test_experts_split_across_two_replicas_match_one(moe_with_tokenizer: Path, dispatch: str,
                                                     leak_check: None) -> None:
    """DP=2 x TP=1 with EP: one EP group of both replicas' ranks (3 + 2 experts),
    the replicas in lockstep, an idle one running dummy batches; the tokens go
    to their experts by all-to-all (the default) or by all-gather."""
    groups: list[Any] = []

    def set_dispatch(llm: Any) -> None:
        for engine in llm.engine.replicas:
            before = engine.executor.collective_rpc(_set_dispatch, args=(dispatch,))
            assert before == [["all_to_all"] * 3]

    def read_groups(llm: Any) -> None:
        groups.extend(e.executor.collective_rpc(_dp_and_ep_groups) for e in llm.engine.replicas)

    one, split = one_replica_then_split(moe_with_tokenizer, before=set_dispatch,
                                        after=read_groups)
    assert groups == [[(0, 2, 0, 2)], [(1, 2, 1, 2)]]
    assert one == split


def _stop_replica_midway(llm: Any, rank: int, after_tokens: int, signum: int) -> Any:
    hit: list[int] = []

    def progress(finished: int, total: int, tokens: int) -> None:
        if not hit and tokens >= after_tokens:
            pid = llm.engine.replicas[rank].executor.workers[0].proc.pid
            os.kill(pid, signum)
            hit.append(pid)

    return progress, hit


def _ep_prompts() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(8)
    return [{"prompt_token_ids": torch.randint(4, 389, (3 + 3 * i,), generator=g).tolist()}
            for i in range(5)]


@pytest.mark.slow
def test_a_frozen_rank_of_experts_across_replicas_is_a_bounded_typed_error(
        moe_with_tokenizer: Path, leak_check: None) -> None:
    """DP=2 with experts across the replicas, no failover: SIGSTOP replica 1's
    worker mid-generate.  Its executor's stall watch kills it, replica 0's
    collective sees the peer gone, and the caller gets the frozen rank's
    WorkerStalledError (the cause, not the peer's broken collective)."""
    from mpexec.engine.llm import LLM
    from mpexec.errors import WorkerStalledError

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(moe_with_tokenizer), data_parallel_size=2, enable_expert_parallel=True,
             num_threads=1, block_size=4, kv_cache_memory_bytes=16 << 20,
             shutdown_grace_s=5.0, worker_stopped_timeout_s=1.0) as llm:
        progress, stopped = _stop_replica_midway(llm, 1, 10, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerStalledError, match="has been stopped"):
            llm.generate(_ep_prompts(), params, progress=progress)
        assert time.monotonic() - started < 60  # not the step deadline (300 s)
        assert stopped and llm.engine.is_dead


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP])
def test_expert_group_restarts_together_and_loses_no_request(
        moe_with_tokenizer: Path, signum: int, leak_check: None) -> None:
    """replica_restart with experts across the replicas: one replica's worker
    killed (or frozen) mid-generate takes the whole expert parallel group
    down; it is rebuilt and joined again, and every request finishes with
    the greedy tokens of an undisturbed run."""
    from mpexec.engine.llm import LLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts_ = _ep_prompts()
    with LLM(str(moe_with_tokenizer), data_parallel_size=2, enable_expert_parallel=True,
             replica_restart=True, num_threads=1, block_size=4,
             kv_cache_memory_bytes=16 << 20, shutdown_grace_s=5.0,
             worker_stopped_timeout_s=1.0) as llm:
        want = [o.token_ids for o in llm.generate(prompts_, params)]
        progress, hit = _stop_replica_midway(llm, 1, 15, signum)
        got = [o.token_ids for o in llm.generate(prompts_, params, progress=progress)]
        failover = llm.engine.failover
        assert all(e is not None for e in llm.engine.replicas)
        groups = [e.executor.collective_rpc(_dp_and_ep_groups) for e in llm.engine.replicas]
    assert hit and got == want
    assert failover.restarts == 1 and failover.requeued_requests == 5, failover.events
    assert failover.recovery_s and [r for r, _ in failover.recovery_s] == [0, 1]
    assert any("taken down with its expert parallel group" in e for e in failover.events) \
        or failover.failures == 2, failover.events
    assert groups == [[(0, 2, 0, 2)], [(1, 2, 1, 2)]]  # the rebuilt group is whole again


def test_expert_parallel_needs_an_moe_model(tiny_checkpoint: Path) -> None:
    with pytest.raises((WorkerError, ValueError), match="needs a mixture-of-experts model"):
        make_executor(tiny_checkpoint, backend="uni", ep=True)
    from mpexec.engine.llm import LLM

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tiny_checkpoint), tensor_parallel_size=2, enable_expert_parallel=True)


def test_more_expert_ranks_than_experts_is_refused() -> None:
    config = ModelConfig.from_hf_dict({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 300,
        "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "max_position_embeddings": 64, "num_local_experts": 2,
        "num_experts_per_tok": 1})
    assert config.moe is not None
    with pytest.raises(ValueError, match="2 experts, fewer than the expert parallel size 3"):
        expert_share(config.moe, 0, 3, True)


def test_more_expert_ranks_than_the_models_experts_is_refused_up_front(
        moe_with_tokenizer: Path, leak_check: None) -> None:
    """EP size = DP x TP = 6 ranks for 5 experts: one ValueError, no worker started."""
    from mpexec.engine.llm import LLM

    with pytest.raises(ValueError, match=r"the model has 5 experts, fewer than the expert "
                                         r"parallel size 6 \(DP x TP ranks\)"):
        LLM(str(moe_with_tokenizer), data_parallel_size=2, tensor_parallel_size=3,
            enable_expert_parallel=True)


def _log_prefix(wrapper: Any) -> str:
    """The prefix this worker puts on every line it prints or logs."""
    import sys

    return str(getattr(sys.stderr, "prefix", ""))


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep", "dp", "want"), [
    (2, True, (0, 1), ["Worker_TP0_EP0", "Worker_TP1_EP1"]),
    (2, False, (1, 2), ["Worker_DP1_TP0", "Worker_DP1_TP1"])])
def test_log_prefixes_carry_the_dp_and_ep_ranks(moe_case: dict[str, Any], tp: int, ep: bool,
                                                dp: tuple[int, int], want: list[str],
                                                leak_check: None) -> None:
    with make_executor(moe_case["path"], tp=tp, ep=ep, dp=dp) as executor:
        pids = [w.pid for w in executor.workers]
        prefixes = executor.collective_rpc(_log_prefix)
    assert prefixes == [f"({name} pid={pid}) " for name, pid in zip(want, pids, strict=True)]


@pytest.mark.slow
def test_a_frozen_expert_rank_is_a_bounded_typed_error(moe_case: dict[str, Any],
                                                       leak_check: None) -> None:
    """SIGSTOP one EP rank mid-step: the step fails within the executor's
    timeout (TimeoutError), it does not hang; shutdown is bounded too."""
    from mpexec.outputs import NewRequestData, SchedulerOutput

    prompt = prompts()["r1"]
    executor = make_executor(moe_case["path"], tp=2, ep=True,
                             executor_fields={"execute_model_timeout_s": 5.0})
    try:
        victim = executor.workers[1].pid
        os.kill(victim, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            executor.execute_model(SchedulerOutput(
                scheduled_new_reqs=[NewRequestData("a", prompt, GREEDY, [0, 1, 2, 3])],
                scheduled_tokens={"a": prompt}, num_computed_tokens={"a": 0}))
            executor.sample_tokens(None)
        assert time.monotonic() - started < 30
    finally:
        ended = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - ended < 60
