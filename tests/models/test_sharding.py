"""The share arithmetic: every head, row and layer lands on exactly one place."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from mpexec.models.sharding import (
    AttentionShard,
    attention_shards,
    pipeline_layers,
    rank_share,
    split_evenly,
)


def test_split_evenly_puts_the_extra_rows_first() -> None:
    assert split_evenly(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_evenly(49152, 2) == [(0, 24576), (24576, 49152)]
    assert split_evenly(1536, 3) == [(0, 512), (512, 1024), (1024, 1536)]
    assert split_evenly(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_nine_heads_three_kv_heads_on_two_ranks() -> None:
    assert attention_shards(9, 3, 2) == [AttentionShard(0, 6, 0, 2), AttentionShard(6, 9, 2, 3)]


def test_tp_equal_to_kv_heads_gives_one_group_each() -> None:
    assert attention_shards(9, 3, 3) == [AttentionShard(0, 3, 0, 1), AttentionShard(3, 6, 1, 2),
                                         AttentionShard(6, 9, 2, 3)]


def test_kv_heads_are_replicated_beyond_their_count() -> None:
    # 4 ranks over 3 KV heads: KV head 0 is held twice, its 3 query heads split 2+1.
    assert attention_shards(9, 3, 4) == [AttentionShard(0, 2, 0, 1), AttentionShard(2, 3, 0, 1),
                                         AttentionShard(3, 6, 1, 2), AttentionShard(6, 9, 2, 3)]
    assert [s.num_heads for s in attention_shards(9, 3, 9)] == [1] * 9


def test_more_ranks_than_query_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"size \(10\) exceeds num_attention_heads"):
        attention_shards(9, 3, 10)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        attention_shards(9, 2, 1)


@given(kv=st.integers(1, 8), group=st.integers(1, 6), data=st.data())
def test_every_query_head_is_held_once_beside_its_kv_head(kv: int, group: int,
                                                          data: st.DataObject) -> None:
    heads = kv * group
    tp = data.draw(st.integers(1, heads))
    shards = attention_shards(heads, kv, tp)
    assert len(shards) == tp
    held = [h for s in shards for h in range(s.q_start, s.q_stop)]
    assert held == list(range(heads))
    for shard in shards:
        assert shard.num_heads >= 1 and shard.num_kv_heads >= 1
        # each query head's KV head (h // group) is on the same rank
        assert {h // group for h in range(shard.q_start, shard.q_stop)} == set(
            range(shard.kv_start, shard.kv_stop))
        assert shard.num_heads % shard.num_kv_heads == 0
    sizes = [s.num_kv_heads for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_rank_share_describes_itself() -> None:
    share = rank_share(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                       layers=(0, 15), tp_rank=1, tp_size=2)
    assert share.intermediate == (768, 1536) and share.vocab == (24576, 49152)
    text = share.describe()
    assert "query heads [6, 9)" in text and "KV heads [2, 3)" in text and "layers [0, 15)" in text


def test_pipeline_layers_even_and_explicit() -> None:
    assert pipeline_layers(30, 2) == [(0, 15), (15, 30)]
    assert pipeline_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert pipeline_layers(30, 2, [10, 20]) == [(0, 10), (10, 30)]


@pytest.mark.parametrize(("partition", "message"), [
    ([10, 10], "sums to 20"),
    ([30], "has 1 entries"),
    ([0, 30], "integers >= 1"),
    ([True, 29], "integers >= 1"),
])
def test_pipeline_partition_is_validated(partition: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipeline_layers(30, 2, partition)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds num_hidden_layers"):
        pipeline_layers(3, 4)
