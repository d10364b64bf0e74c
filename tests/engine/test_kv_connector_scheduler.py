"""The scheduler with a KV connector: pure Python, the CPU offload connector's
scheduler side, and a fake worker that plays its worker side.

The fake worker remembers which tokens filled each block; a "save" copies
that record into a host store keyed by the block hash, a "load" copies it
back (or fails, when told to), so the fake worker's check that a request
starting past position 0 finds the right tokens in its first blocks covers
loaded blocks too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mpexec.engine.request import Request, RequestStatus
from mpexec.engine.scheduler import Scheduler
from mpexec.models.kv_connector import KVTransferConfig
from mpexec.models.kv_connector.offload import OffloadMetadata
from mpexec.outputs import KVConnectorOutput, ModelRunnerOutput, SamplingParams
from tests.engine.fake_worker import FakeModelWorker, reference_tokens
from tests.engine.test_scheduler import BLOCK, fake_worker, make_scheduler

PREFIX = [(7 * i) % 43 + 1 for i in range(20)]  # five full blocks of 4


def offload_scheduler(num_blocks: int = 64, caching: bool = False,
                      num_cpu_blocks: int = 64) -> Scheduler:
    base = make_scheduler(num_blocks=num_blocks)
    config = KVTransferConfig("CPUOffloadConnector", block_size=BLOCK, kv_connector_extra_config={
        "num_cpu_blocks": num_cpu_blocks})
    return Scheduler(replace(base.limits, enable_prefix_caching=caching,
                             kv_transfer_config=config.to_dict()), num_blocks)


class HostSide:
    """The connector's worker side for the fake worker: a dict of block records."""

    def __init__(self, worker: FakeModelWorker) -> None:
        self.worker = worker
        self.store: dict[bytes, tuple[int, ...]] = {}
        self.fail_next_load = False

    def step(self, out: Any) -> KVConnectorOutput:
        meta = out.kv_connector_metadata
        assert isinstance(meta, OffloadMetadata)
        recving, invalid = set(), set()
        for load in meta.loads:
            for block, block_hash in zip(load.block_ids, load.hashes, strict=True):
                if self.fail_next_load:
                    invalid.add(block)
                    continue
                self.worker.block_contents[block] = self.store[block_hash]
            recving.add(load.req_id)
        self.fail_next_load = False
        self.worker.execute_model(out)
        for block_hash in meta.drops:
            self.store.pop(block_hash, None)
        for block, block_hash in meta.saves:
            self.store[block_hash] = self.worker.block_contents[block]
        return KVConnectorOutput(finished_sending={meta.save_id} if meta.saves else None,
                                 finished_recving=recving or None,
                                 invalid_block_ids=invalid or None)


def run(scheduler: Scheduler, host: HostSide, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        out = scheduler.schedule()
        if out is None:
            assert not scheduler.has_unfinished_requests()
            return
        kv = host.step(out)
        result = host.worker.sample_tokens(None) or ModelRunnerOutput()
        scheduler.update_from_output(out, replace(result, kv_connector_output=kv))
    raise AssertionError("did not finish")


def req(req_id: str, suffix: int, max_tokens: int = 5) -> Request:
    return Request(req_id, [*PREFIX, suffix], SamplingParams(max_tokens=max_tokens))


def check(r: Request) -> None:
    assert r.output_token_ids == reference_tokens(r.prompt_token_ids, r.sampling_params)[0]


def test_saved_blocks_are_loaded_by_a_later_request() -> None:
    scheduler = offload_scheduler()
    host = HostSide(fake_worker(64))
    first = req("first", 1)
    scheduler.add_request(first)
    run(scheduler, host)
    connector: Any = scheduler.connector
    assert len(connector.index) == 6  # 21 + 5 tokens: six full blocks computed
    second = req("second", 2)
    scheduler.add_request(second)
    out = scheduler.schedule()  # the load step: nothing computed for it yet
    assert out is not None and out.scheduled_tokens == {}
    assert second.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [load.req_id for load in out.kv_connector_metadata.loads] == ["second"]
    scheduler.update_from_output(out, replace(host.worker.sample_tokens(None) or
                                              ModelRunnerOutput(),
                                              kv_connector_output=host.step(out)))
    nxt = scheduler.schedule()
    assert nxt is not None and nxt.num_computed_tokens == {"second": 20}
    assert [n.req_id for n in nxt.scheduled_new_reqs] == ["second"]
    assert nxt.scheduled_new_reqs[0].block_ids[:5] == out.kv_connector_metadata.loads[0].block_ids
    host.worker.execute_model(nxt)
    scheduler.update_from_output(nxt, replace(host.worker.sample_tokens(None),
                                              kv_connector_output=None))
    run(scheduler, host)
    check(first)
    check(second)
    assert connector.num_loaded_blocks == 5


def test_a_load_is_not_finished_until_reported_and_a_failed_one_is_recomputed() -> None:
    scheduler = offload_scheduler()
    host = HostSide(fake_worker(64))
    scheduler.add_request(req("first", 1))
    run(scheduler, host)
    second = req("second", 2)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert out is not None
    host.step(out)
    # the workers' reply without the load: the request keeps waiting
    scheduler.update_from_output(out, ModelRunnerOutput())
    assert second.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    poll = scheduler.schedule()  # nothing in flight: an empty step to hear from the workers
    assert poll is not None and poll.scheduled_tokens == {}
    host.worker.execute_model(poll)
    scheduler.update_from_output(poll, ModelRunnerOutput(kv_connector_output=KVConnectorOutput(
        finished_recving={"second"}, invalid_block_ids={out.kv_connector_metadata.loads[0]
                                                        .block_ids[2]})))
    # one block failed: everything recomputed, nothing loaded again
    assert second.status is RequestStatus.WAITING and second.skip_kv_load
    connector: Any = scheduler.connector
    assert connector.num_failed_loads == 1
    run(scheduler, host)
    check(second)
    assert scheduler.blocks.num_free_blocks == 64


def test_abort_while_loading_frees_the_blocks() -> None:
    scheduler = offload_scheduler()
    host = HostSide(fake_worker(64))
    scheduler.add_request(req("first", 1))
    run(scheduler, host)
    scheduler.add_request(req("second", 2))
    out = scheduler.schedule()
    assert out is not None
    scheduler.abort_request("second")
    assert scheduler.blocks.num_free_blocks == 64
    kv = host.step(out)
    scheduler.update_from_output(out, ModelRunnerOutput(kv_connector_output=kv))
    assert not scheduler.has_unfinished_requests()


def test_host_store_is_bounded_and_drops_reach_the_workers() -> None:
    scheduler = offload_scheduler(num_cpu_blocks=3)
    host = HostSide(fake_worker(64))
    reqs = [req(f"r{i}", i + 1) for i in range(3)]
    for r in reqs:
        scheduler.add_request(r)
        run(scheduler, host)
    connector: Any = scheduler.connector
    assert len(connector.index) == 3
    run(scheduler, host)
    assert set(host.store) <= set(connector.index) | set(connector._drops)
    for r in reqs:
        check(r)


def test_with_prefix_caching_the_device_cache_is_used_first() -> None:
    scheduler = offload_scheduler(caching=True)
    host = HostSide(fake_worker(64))
    scheduler.add_request(req("first", 1))
    run(scheduler, host)
    scheduler.add_request(req("second", 2))
    out = scheduler.schedule()
    assert out is not None and out.num_computed_tokens == {"second": 20}
    assert not out.kv_connector_metadata.loads  # all five blocks were still on the device
