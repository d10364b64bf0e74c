"""Disaggregated prefill on one machine: a producer engine computes the prompts,
a consumer engine with another TP or PP layout loads their KV and generates.

Greedy and seeded tokens equal those of one colocated engine; a block that
the producer did not finish (no ``complete`` marker) or whose shard is
broken is recomputed by the consumer, never used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_e2e_model import make_llm

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.usefixtures("leak_check")]

PROMPTS = [{"prompt_token_ids": [(29 * i + k) % 230 + 40 for i in range(37 + 5 * k)]}
           for k in range(3)]


def params() -> list[Any]:
    from mpexec import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=9, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]


def shared(path: Path, role: str) -> dict[str, Any]:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"path": str(path)}}


@pytest.fixture(scope="module")
def colocated(tiny_checkpoint: Path) -> list[list[int]]:
    with make_llm(tiny_checkpoint, block_size=4) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params())]


def prefill(tiny_checkpoint: Path, path: Path, tp: int) -> int:
    from mpexec import SamplingParams

    backend = "uni" if tp == 1 else "mp"
    with make_llm(tiny_checkpoint, backend, tp, block_size=4,
                  kv_transfer_config=shared(path, "kv_producer")) as producer:
        producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        saved: int = producer.engine.scheduler.connector.num_saved_blocks  # type: ignore[union-attr]
    return saved


@pytest.mark.parametrize(("producer_tp", "consumer_tp", "consumer_pp"),
                         [(1, 2, 1), (2, 1, 1), (2, 1, 2)])
def test_consumer_generates_from_the_producers_kv(tiny_checkpoint: Path, tmp_path: Path,
                                                  colocated: list[list[int]], producer_tp: int,
                                                  consumer_tp: int, consumer_pp: int) -> None:
    saved = prefill(tiny_checkpoint, tmp_path, producer_tp)
    assert saved == sum(len(p["prompt_token_ids"]) // 4 for p in PROMPTS)
    workers = consumer_tp * consumer_pp
    backend = "uni" if workers == 1 else "mp"
    with make_llm(tiny_checkpoint, backend, consumer_tp, consumer_pp, workers > 1, block_size=4,
                  kv_transfer_config=shared(tmp_path, "kv_consumer")) as consumer:
        out = consumer.generate(PROMPTS, params())
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        # every full block before each prompt's last token came from the producer
        assert connector.num_loaded_blocks == sum((len(p["prompt_token_ids"]) - 1) // 4
                                                  for p in PROMPTS)
        assert connector.num_failed_loads == 0 and connector.num_saved_blocks == 0


def test_unfinished_or_broken_blocks_are_recomputed(tiny_checkpoint: Path, tmp_path: Path,
                                                    colocated: list[list[int]]) -> None:
    from mpexec.engine.prefix_cache import extend_hashes, root_hash

    prefill(tiny_checkpoint, tmp_path, 2)
    chains = []
    for prompt in PROMPTS:
        hashes: list[bytes] = []
        extend_hashes(hashes, prompt["prompt_token_ids"], 4,
                      root_hash(f"{tiny_checkpoint}|auto|auto"))  # model|dtype|quantization
        chains.append([next(tmp_path.rglob(h.hex())) for h in hashes])
    # a producer that died mid-way: the second half of one prompt's blocks never
    # got their marker
    for directory in chains[1][len(chains[1]) // 2:]:
        (directory / "complete").unlink()
    # and the first block of another lost a shard's bytes
    shard = sorted(chains[2][0].glob("*.kv"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    with make_llm(tiny_checkpoint, "mp", 2, 1, True, block_size=4,
                  kv_transfer_config=shared(tmp_path, "kv_consumer")) as consumer:
        out = consumer.generate(PROMPTS, params())
        connector: Any = consumer.engine.scheduler.connector
        assert [o.token_ids for o in out] == colocated
        # prompt 0: all 9 blocks; prompt 1: the 5 marked ones; prompt 2: 11 tried, failed
        assert connector.num_loaded_blocks == 9 + 5 + 11
        assert connector.num_failed_loads == 1
