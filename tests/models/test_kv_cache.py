"""Slot arithmetic, step layout and sizing of the paged KV cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpexec.models.kv_cache import (  # noqa: E402
    KVCache,
    ScheduledRequest,
    build_attention_batch,
    free_host_memory,
    kv_block_bytes,
    memory_budget,
)

pytestmark = pytest.mark.torch
CPU = torch.device("cpu")


def test_slots_follow_the_block_table() -> None:
    batch = build_attention_batch([ScheduledRequest([7, 2, 5], 0, 10)], 4, CPU)
    assert batch.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert len(batch.prefills) == 1 and batch.prefills[0].context_slots is None


def test_decode_rows_are_padded_with_their_own_first_slot_and_masked() -> None:
    batch = build_attention_batch([ScheduledRequest([3], 2, 1), ScheduledRequest([1, 6], 5, 1)],
                                  4, CPU)
    assert batch.slot_mapping.tolist() == [14, 25]
    assert batch.decode_rows is None  # every row decodes, in order
    assert batch.decode_slots is not None and batch.decode_mask is not None
    assert batch.decode_slots.tolist() == [[12, 13, 14, 12, 12, 12], [4, 5, 6, 7, 24, 25]]
    assert batch.decode_mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 3, [True] * 6]


def test_a_chunk_after_cached_tokens_sees_them_causally() -> None:
    batch = build_attention_batch([ScheduledRequest([0, 1], 3, 2)], 4, CPU)
    (span,) = batch.prefills
    assert span.context_slots is not None and span.mask is not None
    assert span.context_slots.tolist() == [0, 1, 2, 3, 4]
    assert span.mask.tolist() == [[True] * 4 + [False], [True] * 5]


def test_a_step_past_the_block_table_is_refused() -> None:
    with pytest.raises(ValueError, match="reaches position 8 but its block table holds 2 blocks"):
        build_attention_batch([ScheduledRequest([0, 1], 6, 3)], 4, CPU)


def test_block_bytes_and_the_pool() -> None:
    assert kv_block_bytes(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64,
                          dtype=torch.float32) == 30 * 2 * 16 * 3 * 64 * 4
    assert kv_block_bytes(num_layers=1, block_size=16, num_kv_heads=1, head_dim=64,
                          dtype=torch.bfloat16) == 2 * 16 * 64 * 2
    cache = KVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=8,
                    dtype=torch.float32, device=CPU)
    k, v = cache.layer(1)
    assert k.shape == v.shape == (24, 3, 8) and cache.scratch_block == 5
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCache(num_layers=1, num_blocks=0, block_size=4, num_kv_heads=1, head_dim=8,
                dtype=torch.float32, device=CPU)


def test_memory_budget() -> None:
    assert memory_budget(CPU, 12345, 2) == 12345
    free = free_host_memory()
    assert free > 0
    assert 0 < memory_budget(CPU, None, 2) <= free // 2
