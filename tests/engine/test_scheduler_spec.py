"""The scheduler's side of speculative decoding: pure Python, no processes.

Drafts get KV slots and budget, are capped by max_tokens and the context,
the rejected tail is rolled back (computed tokens, blocks, the workers'
block tables), and a stop inside an accepted run cuts it.
"""

from __future__ import annotations

from mpexec.engine.request import FinishReason, Request, RequestStatus
from mpexec.engine.scheduler import Scheduler, SchedulerLimits
from mpexec.outputs import DraftTokenIds, ModelRunnerOutput, SamplingParams

BLOCK = 4


def make_scheduler(k: int = 4, num_blocks: int = 16, max_model_len: int = 64) -> Scheduler:
    limits = SchedulerLimits(max_model_len=max_model_len, max_num_batched_tokens=32,
                             max_num_seqs=4, block_size=BLOCK, num_speculative_tokens=k,
                             enable_prefix_caching=True)
    return Scheduler(limits, num_blocks, eos_token_ids=(0,))


def decoding(scheduler: Scheduler, prompt: list[int], **params: object) -> Request:
    """A request past its prefill (its first token sampled: 9)."""
    request = Request("r", prompt, SamplingParams(**params))  # type: ignore[arg-type]
    scheduler.add_request(request)
    step = scheduler.schedule()
    assert step is not None
    scheduler.update_from_output(step, ModelRunnerOutput(["r"], [[9]]))
    return request


def test_drafts_run_behind_the_decode_token_and_the_rejected_tail_rolls_back() -> None:
    scheduler = make_scheduler()
    request = decoding(scheduler, [1, 2, 3, 4, 5, 6, 7], max_tokens=20)  # 8 tokens: 2 blocks
    scheduler.update_draft_token_ids(0, DraftTokenIds(["r"], [[5, 6, 7, 8, 1]]))
    step = scheduler.schedule()
    assert step is not None
    assert step.scheduled_tokens["r"] == [9, 5, 6, 7, 8]  # k = 4 of the 5 proposed
    assert step.scheduled_spec_decode_tokens["r"] == [5, 6, 7, 8]
    assert step.num_computed_tokens["r"] == 7
    assert len(request.block_ids) == 3  # positions 7..11: a third block
    # two drafts accepted, the third replaced: 5 6 then 4
    scheduler.update_from_output(step, ModelRunnerOutput(["r"], [[5, 6, 4]]))
    assert request.output_token_ids == [9, 5, 6, 4]
    assert request.num_computed_tokens == 10  # 7 + the decode token + 2 accepted
    assert len(request.block_ids) == 3  # positions 8..9 live in the third block
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.accepted_per_position) == (1, 4, 2, [1, 1, 0, 0])
    # nothing accepted: the block that held only drafts is freed, the workers told
    scheduler.update_draft_token_ids(1, DraftTokenIds(["r"], [[1, 2, 3]]))
    step = scheduler.schedule()
    assert step is not None and step.scheduled_tokens["r"] == [4, 1, 2, 3]
    assert len(request.block_ids) == 4  # positions 10..13
    free = scheduler.blocks.num_free_blocks
    scheduler.update_from_output(step, ModelRunnerOutput(["r"], [[7]]))
    assert request.num_computed_tokens == 11 and len(request.block_ids) == 3
    assert scheduler.blocks.num_free_blocks == free + 1
    step = scheduler.schedule()  # no drafts this time
    assert step is not None and step.truncated_block_tables == {"r": 3}
    assert step.scheduled_tokens["r"] == [7] and not step.scheduled_spec_decode_tokens


def test_drafts_are_capped_by_max_tokens_and_the_context() -> None:
    scheduler = make_scheduler(max_model_len=12)
    decoding(scheduler, [1, 2, 3, 4, 5, 6, 7], max_tokens=4)
    scheduler.update_draft_token_ids(0, DraftTokenIds(["r"], [[5, 6, 7, 8]]))
    step = scheduler.schedule()
    assert step is not None
    assert step.scheduled_spec_decode_tokens["r"] == [5, 6]  # 1 output + 2 drafts + 1 = 4
    scheduler = make_scheduler(max_model_len=10)
    decoding(scheduler, [1, 2, 3, 4, 5, 6, 7], max_tokens=20)
    scheduler.update_draft_token_ids(0, DraftTokenIds(["r"], [[5, 6, 7, 8]]))
    step = scheduler.schedule()
    assert step is not None
    assert step.scheduled_spec_decode_tokens["r"] == [5, 6]  # positions 8, 9 of 10


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there() -> None:
    scheduler = make_scheduler()
    request = decoding(scheduler, [1, 2, 3, 4, 5, 6, 7], max_tokens=20, stop_token_ids=[6])
    scheduler.update_draft_token_ids(0, DraftTokenIds(["r"], [[5, 6, 7]]))
    step = scheduler.schedule()
    assert step is not None
    scheduler.update_from_output(step, ModelRunnerOutput(["r"], [[5, 6, 7, 8]]))
    assert request.output_token_ids == [9, 5, 6]
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == 6
    assert scheduler.blocks.num_free_blocks == 16  # every block back (some cached)


def test_a_request_with_penalties_never_carries_drafts() -> None:
    scheduler = make_scheduler()
    request = decoding(scheduler, [1, 2, 3], max_tokens=20, presence_penalty=0.5)
    scheduler.update_draft_token_ids(0, DraftTokenIds(["r"], [[5, 6]]))
    assert request.spec_token_ids == [] and request.status is RequestStatus.RUNNING
    step = scheduler.schedule()
    assert step is not None and step.scheduled_tokens["r"] == [9]
