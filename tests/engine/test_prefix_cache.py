"""Prefix caching in the block manager and the scheduler: pure Python, no processes.

The fake worker (``drive``) checks that every block served from the cache
holds the KV it wrote for exactly the same tokens, and that no shared
block is ever written.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from mpexec.engine.block_manager import BlockManager
from mpexec.engine.prefix_cache import chain_hash, extend_hashes, root_hash
from mpexec.engine.request import Request
from mpexec.engine.scheduler import Scheduler
from mpexec.outputs import ModelRunnerOutput, SamplingParams
from tests.engine.fake_worker import reference_tokens
from tests.engine.test_scheduler import drive, fake_worker, make_scheduler


def req(req_id: str, prompt: list[int], max_tokens: int = 4, **params: object) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]


SHARED = [(5 * i) % 41 + 1 for i in range(12)]  # three full blocks of 4


def test_hashes_chain_the_whole_prefix_and_the_namespace() -> None:
    root = root_hash("model-a")
    a: list[bytes] = []
    extend_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, root)
    assert len(a) == 2  # only full blocks are named
    b: list[bytes] = []
    extend_hashes(b, [9, 2, 3, 4, 5, 6, 7, 8], 4, root)
    assert a[0] != b[0] and a[1] != b[1]  # same block tokens, different prefix
    assert a[1] == chain_hash(chain_hash(root, [1, 2, 3, 4]), [5, 6, 7, 8])
    c: list[bytes] = []
    extend_hashes(c, [1, 2, 3, 4], 4, root_hash("model-b"))
    assert c[0] != a[0]
    assert root_hash("model-a") == root  # stable: an offload store names blocks by it


def test_reference_counts_and_lru_eviction() -> None:
    manager = BlockManager(4, 4, enable_caching=True)
    a = manager.allocate("a", 2)
    manager.cache(a[0], b"h0")
    manager.cache(a[1], b"h1")
    assert manager.find_cached([b"h0", b"h1", b"h2"]) == a
    manager.take("b", a[:1])  # b shares a's first block
    manager.free("a", a)
    # a's first block is still held by b; its second is cached, evictable
    assert manager.num_free_blocks == 3 and manager.find_cached([b"h0", b"h1"]) == a
    c = manager.allocate("c", 2)  # the two plainly free blocks go first
    assert set(c) == {2, 3} and manager.num_cached_blocks == 2
    d = manager.allocate("d", 1)  # then the least recently freed cached block
    assert d == [a[1]] and manager.num_evictions == 1
    assert manager.find_cached([b"h0", b"h1"]) == [a[0]]
    with pytest.raises(RuntimeError):
        manager.allocate("e", 1)  # b's block is in use: never evicted
    manager.free("b", [a[0]])
    assert manager.num_free_blocks == 1 and manager.find_cached([b"h0"]) == [a[0]]
    with pytest.raises(RuntimeError, match="held by c"):
        manager.free("x", c[:1])
    manager.free("c", c)
    manager.free("d", d)
    assert manager.reset_prefix_cache() and manager.num_free_blocks == 4


def test_lru_order_is_least_recently_freed_and_tail_first() -> None:
    manager = BlockManager(4, 4, enable_caching=True)
    old = manager.allocate("old", 2)
    new = manager.allocate("new", 2)
    for block, name in zip(old + new, (b"o0", b"o1", b"n0", b"n1"), strict=True):
        manager.cache(block, name)
    manager.free("old", old)
    manager.free("new", new)
    # the older request goes first, its tail before its head
    assert manager.allocate("x", 3) == [old[1], old[0], new[1]]
    assert manager.find_cached([b"n0"]) == [new[0]]


def test_second_request_computes_only_what_is_not_cached() -> None:
    scheduler = make_scheduler()
    first = req("first", [*SHARED, 7, 8])
    scheduler.add_request(first)
    worker = fake_worker(64)
    drive(scheduler, worker=worker)
    second = req("second", [*SHARED, 9])
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out is not None
    assert out.num_computed_tokens == {"second": 12}
    assert out.scheduled_tokens == {"second": [9]}
    worker.execute_model(out)
    scheduler.update_from_output(out, worker.sample_tokens(None))
    drive(scheduler, worker=worker)
    assert second.num_cached_tokens == 12
    assert second.output_token_ids == reference_tokens(second.prompt_token_ids,
                                                       second.sampling_params)[0]
    stats = scheduler.blocks.stats
    assert stats.queries == 14 + 13 and stats.hits == 12


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    scheduler = make_scheduler()
    worker = fake_worker(64)
    scheduler.add_request(req("a", SHARED))
    drive(scheduler, worker=worker)
    again = req("b", SHARED)
    scheduler.add_request(again)
    out = scheduler.schedule()
    assert out is not None
    # 12 tokens = 3 full blocks; the last block is recomputed in a block of its own
    assert out.num_computed_tokens == {"b": 8}
    assert len(out.scheduled_tokens["b"]) == 4
    worker.execute_model(out)
    scheduler.update_from_output(out, worker.sample_tokens(None))
    drive(scheduler, worker=worker)
    assert again.output_token_ids == reference_tokens(SHARED, again.sampling_params)[0]


def test_blocks_of_one_step_are_shared_only_from_the_next_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(req("a", [*SHARED, 1]))
    scheduler.add_request(req("b", [*SHARED, 2]))
    out = scheduler.schedule()
    assert out is not None and out.num_computed_tokens == {"a": 0, "b": 0}
    scheduler.add_request(req("c", [*SHARED, 3]))
    nxt = scheduler.schedule()
    assert nxt is not None and nxt.num_computed_tokens["c"] == 12


def test_switched_off_nothing_is_shared() -> None:
    scheduler = make_scheduler()
    scheduler = Scheduler(replace(scheduler.limits, enable_prefix_caching=False), 64)
    worker = fake_worker(64)
    scheduler.add_request(req("a", [*SHARED, 1]))
    drive(scheduler, worker=worker)
    scheduler.add_request(req("b", [*SHARED, 1]))
    out = scheduler.schedule()
    assert out is not None and out.num_computed_tokens == {"b": 0}
    assert scheduler.blocks.num_cached_blocks == 0 and scheduler.blocks.stats.queries == 0


def test_eviction_under_pressure_and_preemption_keep_counts_right() -> None:
    # 8 blocks: four requests sharing 3 blocks of prefix and growing past them
    scheduler = make_scheduler(num_blocks=8, budget=64)
    reqs = [req(f"r{i}", [*SHARED, i + 1], max_tokens=10) for i in range(4)]
    for r in reqs:
        scheduler.add_request(r)
    worker = fake_worker(8)
    drive(scheduler, worker=worker)
    assert scheduler.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling_params)[0]
    assert scheduler.blocks.num_free_blocks == 8
    assert not scheduler.blocks._holders  # every reference returned
    # a prompt that needs every block evicts the whole cache
    big = req("big", [40 - (i % 30) for i in range(30)], max_tokens=2)
    scheduler.add_request(big)
    drive(scheduler, worker=worker)
    assert scheduler.blocks.num_evictions > 0
    assert big.output_token_ids == reference_tokens(big.prompt_token_ids,
                                                    big.sampling_params)[0]


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    scheduler = make_scheduler(num_blocks=6, budget=64)
    a, b = req("a", SHARED[:8], max_tokens=12), req("b", SHARED[4:12], max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    worker = fake_worker(6)
    resumed: list[int] = []
    execute = worker.execute_model

    def spy(out):  # type: ignore[no-untyped-def]
        for new in out.scheduled_new_reqs:
            if new.req_id == "b" and len(new.prompt_token_ids) > 8:
                resumed.append(out.num_computed_tokens["b"])
        execute(out)

    worker.execute_model = spy  # type: ignore[method-assign]
    drive(scheduler, worker=worker)
    assert b.num_preemptions >= 1 and resumed
    for r in (a, b):
        assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling_params)[0]


def test_late_token_after_abort_of_a_sharing_request() -> None:
    scheduler = make_scheduler()
    worker = fake_worker(64)
    scheduler.add_request(req("a", [*SHARED, 1]))
    drive(scheduler, worker=worker)
    scheduler.add_request(req("b", [*SHARED, 2]))
    scheduler.add_request(req("c", [*SHARED, 3]))
    out = scheduler.schedule()
    assert out is not None
    shared = out.scheduled_new_reqs[0].block_ids[:3]
    assert out.scheduled_new_reqs[1].block_ids[:3] == shared
    scheduler.abort_request("b")
    assert all(block in scheduler.blocks._holders for block in shared)  # c holds them
    scheduler.update_from_output(out, ModelRunnerOutput(req_ids=["b", "c"],
                                                        sampled_token_ids=[[1], [2]]))
    scheduler.abort_request("c")
    assert scheduler.blocks.num_free_blocks == 64 and not scheduler.blocks._holders


@settings(max_examples=60, deadline=None)
@given(
    suffix_lens=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    prefix_len=st.integers(0, 14),
    max_tokens=st.lists(st.integers(1, 12), min_size=7, max_size=7),
    budget=st.integers(1, 40),
    extra_blocks=st.integers(0, 16),
    max_num_seqs=st.integers(1, 5),
    depth=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
)
def test_shared_prefixes_give_the_same_tokens_with_and_without_caching(
        suffix_lens: list[int], prefix_len: int, max_tokens: list[int], budget: int,
        extra_blocks: int, max_num_seqs: int, depth: int, pp: int) -> None:
    max_model_len = 40
    num_blocks = 10 + extra_blocks

    def run(caching: bool) -> tuple[list[list[int]], int]:
        base = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len,
                              budget=budget, max_num_seqs=max_num_seqs, eos=(5,))
        scheduler = Scheduler(replace(base.limits, enable_prefix_caching=caching),
                              num_blocks, (5,))
        reqs = []
        for i, n in enumerate(suffix_lens):
            prompt = [(3 * j) % 31 + 1 for j in range(prefix_len)] + [i + 1] * max(n, 1)
            reqs.append(req(f"r{i}", prompt, max_tokens=max_tokens[i], seed=i,
                            temperature=1.0))
            scheduler.add_request(reqs[-1])
        drive(scheduler, depth=depth if pp == 1 else pp, pp=pp)
        assert scheduler.blocks.num_free_blocks == num_blocks
        for r in reqs:
            want = reference_tokens(r.prompt_token_ids, r.sampling_params, eos_token_ids=(5,),
                                    max_model_len=max_model_len)
            assert (r.output_token_ids, r.finish_reason.value) == want
        return [r.output_token_ids for r in reqs], scheduler.blocks.stats.hits

    with_cache, _hits = run(True)
    without, no_hits = run(False)
    assert with_cache == without and no_hits == 0


def test_a_long_prompts_blocks_are_not_a_short_prompts() -> None:
    """Packed weights round a long prompt's tokens (before its last) once and
    split a short prompt's (``split_rule``): their blocks hold different KV,
    so the same leading tokens are different blocks.  Long prompts share
    with each other, short ones with each other."""
    from mpexec.models.split_rule import SPLIT_PROMPT

    head = [(3 * i) % 47 + 1 for i in range(16)]  # four full blocks of 4
    scheduler = make_scheduler(num_blocks=256, budget=256)
    worker = fake_worker(256)
    cached = {}
    for offset, (name, length) in enumerate((("long", SPLIT_PROMPT + 10),
                                             ("long2", SPLIT_PROMPT + 20),
                                             ("short", 20), ("short2", 24))):
        tail = [(5 * i + offset) % 43 + 1 for i in range(length - len(head))]
        request = req(name, head + tail)
        scheduler.add_request(request)
        drive(scheduler, worker=worker)
        cached[name] = request.num_cached_tokens
    assert cached == {"long": 0, "long2": 16, "short": 0, "short2": 16}
