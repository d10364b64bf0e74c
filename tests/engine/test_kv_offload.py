"""The CPU offload KV connector end to end on the tiny checkpoint.

Blocks computed once are saved to host memory (or disk); a later request
with the same prefix loads them instead of recomputing, and its tokens are
exactly those of an engine without any cache.  With TP = 2 the executor's
aggregator counts a load finished only when both ranks reported it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PREFIX = [(41 * i) % 240 + 30 for i in range(50)]
FIRST = {"prompt_token_ids": [*PREFIX, 301, 302]}
SECOND = [{"prompt_token_ids": [*PREFIX, 310 + i]} for i in range(2)]


def params() -> Any:
    from mpexec import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=4, max_tokens=8, ignore_eos=True)]


def offload(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "CPUOffloadConnector", "kv_connector_extra_config": extra}


def run(llm: Any) -> list[list[int]]:
    first = llm.generate([FIRST], params()[:1])
    second = llm.generate(SECOND, params())
    return [o.token_ids for o in first + second]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint, block_size=4, enable_prefix_caching=False) as llm:
        return run(llm)


def connector(llm: Any) -> Any:
    return llm.engine.scheduler.connector


def test_reload_from_host_memory_gives_the_same_tokens(tiny_checkpoint: Path,
                                                       reference: list[list[int]]) -> None:
    # no GPU prefix cache: every reuse of the prefix comes through the connector
    with make_llm(tiny_checkpoint, block_size=4, enable_prefix_caching=False,
                  kv_transfer_config=offload()) as llm:
        assert run(llm) == reference
        assert connector(llm).num_loaded_blocks >= 2 * 12
        assert connector(llm).num_failed_loads == 0


def test_blocks_evicted_from_the_kv_cache_come_back_from_host_memory(
        tiny_checkpoint: Path, reference: list[list[int]]) -> None:
    from mpexec import SamplingParams

    with make_llm(tiny_checkpoint, "uni", block_size=4) as probe:
        block_bytes = probe.engine.executor.collective_rpc("kv_cache_block_bytes")[0]
    with make_llm(tiny_checkpoint, "mp", 1, 1, True, block_size=4,
                  kv_cache_memory_bytes=40 * block_bytes,
                  kv_transfer_config=offload(num_cpu_blocks=64)) as llm:
        first = llm.generate([FIRST], params()[:1])
        # other prompts fill the 40 blocks: the prefix is evicted from the KV cache
        llm.generate([{"prompt_token_ids": [200 + i] * 100} for i in range(2)],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert llm.engine.scheduler.blocks.num_evictions > 0
        loaded = connector(llm).num_loaded_blocks
        second = llm.generate(SECOND, params())
        assert [o.token_ids for o in first + second] == reference
        assert connector(llm).num_loaded_blocks > loaded


def test_disk_store_survives_the_engine(tiny_checkpoint: Path, tmp_path: Path,
                                        reference: list[list[int]]) -> None:
    config = offload(disk_path=str(tmp_path / "kv"), num_cpu_blocks=8)
    with make_llm(tiny_checkpoint, block_size=4, kv_transfer_config=config) as llm:
        assert run(llm)[0] == reference[0]
    assert list((tmp_path / "kv").rglob("*.kv"))
    # a new engine: its KV cache is empty, the disk holds the prefix
    with make_llm(tiny_checkpoint, block_size=4, kv_transfer_config=config) as llm:
        assert len(connector(llm).index) > 0
        out = llm.generate(SECOND, params())
        assert [o.token_ids for o in out] == reference[1:]
        assert connector(llm).num_loaded_blocks >= 12


def test_a_failed_load_is_recomputed(tiny_checkpoint: Path, tmp_path: Path,
                                     reference: list[list[int]]) -> None:
    config = offload(disk_path=str(tmp_path / "kv"), num_cpu_blocks=8)
    with make_llm(tiny_checkpoint, block_size=4, kv_transfer_config=config) as llm:
        run(llm)
    with make_llm(tiny_checkpoint, block_size=4, kv_transfer_config=config) as llm:
        for path in (tmp_path / "kv").rglob("*.kv"):  # listed at start-up, gone now
            path.write_bytes(b"broken")
        out = llm.generate(SECOND, params())
        assert [o.token_ids for o in out] == reference[1:]
        assert connector(llm).num_failed_loads >= 1


def test_tp2_load_counts_only_when_both_ranks_report(tiny_checkpoint: Path,
                                                     reference: list[list[int]]) -> None:
    lagging = {"kv_connector": "tests.engine.kv_connectors:LaggingOffloadConnector"}
    for config in (offload(), lagging):
        with make_llm(tiny_checkpoint, "mp", 2, 1, True, block_size=4,
                      enable_prefix_caching=False, kv_transfer_config=config) as llm:
            assert run(llm) == reference, config
            assert connector(llm).num_loaded_blocks >= 2 * 12
            if config is lagging:
                lags = llm.engine.executor.collective_rpc(
                    lambda worker: worker.connector.lagged_loads)
                assert lags[0] == 0 and lags[1] > 0
