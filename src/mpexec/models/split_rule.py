"""Which tokens pass their activations to packed weights as bfloat16 high + low.

The packed kernels (``layers.quantized``) take bfloat16 activations; a token
that *splits* passes ``x`` as ``bf16(x)`` plus the bfloat16 remainder and
keeps ~16 bits, one that does not is rounded to bfloat16 once (8 bits)::

    prompt of up to SPLIT_PROMPT tokens    every token splits
    longer prompt                          its last token and every later one
                                           (what is sampled, and what decode
                                           steps feed back) split; the rest round

The rule depends on the token's position and its request's prompt length,
never on the step it runs in, so a token's KV is the same whatever shares
its step and whenever it is computed again (a preempted or re-queued
request's prefix).  Two places apply it: the model worker, per row of a
step (``step.RequestTable.prepare``), and the scheduler, in the names of
cached KV blocks (``engine.prefix_cache``): a block rounded differently is a
different block.  Torch-free, so that the scheduler can import it.
"""

from __future__ import annotations

SPLIT_PROMPT = 64  # prompts of at most this many tokens split every token


def split_from(num_prompt_tokens: int) -> int:
    """The first position that splits, in a request with that many prompt tokens."""
    return 0 if num_prompt_tokens <= SPLIT_PROMPT else num_prompt_tokens - 1


def row_splits(position: int, num_prompt_tokens: int) -> bool:
    """Does the token at ``position`` pass its activations as high + low?"""
    return position >= split_from(num_prompt_tokens)
