"""The sampler against reference computations."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mpexec.models.sampler import (  # noqa: E402
    SampleRequest,
    noise_seed,
    sample,
    unpack_bitmask,
)
from mpexec.outputs import SamplingParams  # noqa: E402

pytestmark = pytest.mark.torch


def request(seed: int = 0, position: int = 0, **params: object) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), seed, position)  # type: ignore[arg-type]


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    logits = logits_rows(4)
    tokens, logprobs = sample(logits, [request(temperature=0, logprobs=True)] * 4)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs is not None
    expected = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor([row.logprob for row in logprobs]), expected)
    assert all(row.rank == 1 and row.top_ids == [] for row in logprobs)


def test_no_logprobs_unless_asked() -> None:
    assert sample(logits_rows(2), [request(temperature=0)] * 2)[1] is None


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The textbook definition, written independently of the sampler."""
    probs = torch.softmax(logits / params.temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True).tolist()
    if params.top_k > 0:
        keep[order[params.top_k:]] = False
    if params.top_p < 1:
        mass = 0.0
        for rank, token in enumerate(order):
            if rank > 0 and mass >= params.top_p:
                keep[token] = False
            mass += float(probs[token])
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum()


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.5, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02),
])
def test_sampled_frequencies_follow_the_filtered_distribution(params: dict[str, object]) -> None:
    vocab = 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    probs = reference_probs(logits, SamplingParams(**params))  # type: ignore[arg-type]
    draws = 3000
    tokens, _ = sample(logits.expand(draws, vocab).contiguous(),
                       [request(seed=7, position=p, **params) for p in range(draws)])
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    assert all(probs[t] > 0 for t in tokens), "a token outside the support was drawn"
    # Each count is binomial; 5 standard deviations is deterministic here
    # (fixed seeds) and loose enough to stay true for any correct sampler.
    expected = probs.double() * draws
    sigma = (expected * (1 - probs.double())).sqrt()
    assert bool(((counts - expected).abs() <= 5 * sigma + 1).all()), (counts, expected)


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    logits = logits_rows(6, vocab=1000)
    params = dict(temperature=1.0, top_p=0.95)
    alone = [sample(logits[i:i + 1], [request(seed=i, position=10 + i, **params)])[0][0]
             for i in range(6)]
    order = [4, 1, 5, 0, 3, 2]
    batch, _ = sample(logits[order], [request(seed=i, position=10 + i, **params) for i in order])
    assert batch == [alone[i] for i in order]
    mixed, _ = sample(logits[:3], [request(seed=0, position=10, **params),
                                   request(temperature=0), request(seed=2, position=12, **params)])
    assert mixed[0] == alone[0] and mixed[2] == alone[2]


def test_seed_and_position_both_change_the_stream() -> None:
    seeds = {noise_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400
    logits = torch.zeros(30, 1000)
    tokens, _ = sample(logits, [request(seed=5, position=p) for p in range(30)])
    assert len(set(tokens)) > 20  # uniform over 1000: repeats would be a broken stream


def pack(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            mask[row, token // 32] |= 1 << (token % 32)
    # int32 words, bit 31 included (the sign bit): wrap as two's complement
    return ((mask + 2**31) % 2**32 - 2**31).to(torch.int32)


def test_bitmask_unpacks_every_bit_including_the_sign_bit() -> None:
    vocab = 70
    allowed = [[0, 31, 32, 63, 69], [5]]
    mask = unpack_bitmask(pack(allowed, vocab).numpy(), vocab, torch.device("cpu"))
    assert mask.shape == (2, vocab)
    assert [torch.nonzero(row).flatten().tolist() for row in mask] == allowed


def test_grammar_mask_gives_disallowed_tokens_probability_zero() -> None:
    vocab = 64
    logits = logits_rows(2, vocab)
    allowed_tokens = [[3, 40, 63], [17]]
    allowed = unpack_bitmask(pack(allowed_tokens, vocab), vocab, torch.device("cpu"))
    for params in (dict(temperature=0), dict(temperature=2.0)):
        for position in range(50):
            tokens, logprobs = sample(logits, [request(position=position, logprobs=True,
                                                       **params)] * 2, allowed)
            assert tokens[0] in allowed_tokens[0] and tokens[1] == 17
            assert logprobs is not None and logprobs[1] is not None
            assert logprobs[1].logprob == pytest.approx(0.0, abs=1e-6)


def test_a_row_with_nothing_allowed_is_an_error_not_a_placeholder() -> None:
    allowed = torch.zeros(1, 10, dtype=torch.bool)
    with pytest.raises(ValueError, match="allows no token"):
        sample(torch.zeros(1, 10), [request(temperature=0)], allowed)


def test_short_bitmask_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 4"):
        unpack_bitmask(torch.zeros(1, 3, dtype=torch.int32), 100, torch.device("cpu"))


def test_to_host_list_on_the_cpu_is_tolist() -> None:
    from mpexec.models.sampler import to_host_list

    values = torch.tensor([3, 1, 2])
    assert to_host_list(values) == [3, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_host_list_from_cuda_goes_through_pinned_memory() -> None:
    from mpexec.models.sampler import to_host_list

    values = torch.arange(5, device="cuda")
    assert to_host_list(values) == [0, 1, 2, 3, 4]
    logits = torch.randn(3, 11, device="cuda")
    requests = [SampleRequest(SamplingParams(temperature=0), seed=0, position=0)] * 3
    tokens, _ = sample(logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist()


# -- penalties, bias, min_tokens: against transformers' logits processors and by hand --------


def history(tokens: list[int], prompt_len: int) -> object:
    from mpexec.models.sampler import TokenHistory

    return TokenHistory(tokens, prompt_len)


def processed(logits: torch.Tensor, reqs: list[SampleRequest]) -> torch.Tensor:
    from mpexec.models.sampler import process_logits

    return process_logits(logits, reqs)


def test_repetition_penalty_matches_transformers() -> None:
    lp = pytest.importorskip("transformers.generation.logits_process")
    vocab = 40
    logits = logits_rows(3, vocab, seed=1)
    sequences = [[1, 5, 5, 7, 30], [2, 2, 2], [39, 0, 11, 12, 13, 14]]
    reqs = [SampleRequest(SamplingParams(repetition_penalty=penalty), 0, len(seq),
                          history=history(seq, 2))  # type: ignore[arg-type]
            for penalty, seq in zip((1.3, 0.7, 2.0), sequences, strict=True)]
    got = processed(logits, reqs)
    for row, (seq, penalty) in enumerate(zip(sequences, (1.3, 0.7, 2.0), strict=True)):
        want = lp.RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([seq]), logits[row:row + 1].clone())
        torch.testing.assert_close(got[row:row + 1], want)


def test_frequency_and_presence_count_output_tokens_only() -> None:
    vocab = 20
    logits = logits_rows(1, vocab, seed=2)
    prompt, output = [3, 3, 4], [4, 5, 5, 5]
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = processed(logits, [SampleRequest(params, 0, 7, history=history(prompt + output, 3))])  # type: ignore[arg-type]
    want = logits.clone()
    for token in set(output):
        want[0, token] -= 0.5 * output.count(token) + 0.25
    torch.testing.assert_close(got, want)  # token 3 (prompt only) untouched


def test_history_counts_incrementally_like_from_scratch() -> None:
    from mpexec.models.sampler import TokenHistory

    tokens = [1, 2, 3]
    incremental = TokenHistory(tokens, 2)
    cpu = torch.device("cpu")
    for token in [7, 7, 1, 9]:
        incremental.vectors(len(tokens), 10, cpu)
        tokens.append(token)
    counts, in_prompt = incremental.vectors(len(tokens), 10, cpu)
    fresh_counts, fresh_prompt = TokenHistory(list(tokens), 2).vectors(len(tokens), 10, cpu)
    assert counts.tolist() == fresh_counts.tolist() == [0, 1, 0, 1, 0, 0, 0, 2, 0, 1]
    assert in_prompt.tolist() == fresh_prompt.tolist()
    assert torch.nonzero(in_prompt).flatten().tolist() == [1, 2]


def test_min_tokens_matches_transformers_and_logit_bias_adds() -> None:
    lp = pytest.importorskip("transformers.generation.logits_process")
    vocab = 16
    logits = logits_rows(2, vocab, seed=4)
    params = SamplingParams(min_tokens=3, max_tokens=10, logit_bias={5: 2.5, "6": -100})
    reqs = [SampleRequest(params, 0, 12, num_output_tokens=n, min_tokens_stop_ids=(2, 9))
            for n in (1, 3)]
    got = processed(logits, reqs)
    for row, n in enumerate((1, 3)):
        want = lp.MinNewTokensLengthLogitsProcessor(10, 3, [2, 9])(
            torch.zeros(1, 10 + n, dtype=torch.long), logits[row:row + 1].clone())
        want[0, 5] += 2.5
        want[0, 6] -= 100
        torch.testing.assert_close(got[row:row + 1], want)


def test_greedy_picks_the_argmax_after_penalties_and_leaves_other_rows_alone() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    penalised = SampleRequest(SamplingParams(temperature=0, repetition_penalty=2.0), 0, 3,
                              history=history([0, 0, 0], 3))  # type: ignore[arg-type]
    tokens, _ = sample(logits, [penalised, request(temperature=0)])
    assert tokens == [1, 0]
    assert logits.tolist() == [[5.0, 4.0, 1.0]] * 2  # the input is not modified


def test_top_logprobs_and_ranks() -> None:
    logits = logits_rows(3, 30, seed=5)
    reqs = [request(temperature=1.0, seed=1, position=p, logprobs=k) for p, k in
            enumerate((0, 3, 20))]
    tokens, rows = sample(logits, reqs)
    assert rows is not None
    reference = torch.log_softmax(logits, -1)
    for i, (row, k) in enumerate(zip(rows, (0, 3, 20), strict=True)):
        assert row is not None and row.token_id == tokens[i]
        assert row.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-6)
        order = reference[i].argsort(descending=True).tolist()
        assert row.rank == order.index(tokens[i]) + 1
        assert row.top_ids == order[:k]
        assert row.top_logprobs == pytest.approx(reference[i, order[:k]].tolist(), abs=1e-6)
    mixed = sample(logits[:2], [request(temperature=0), request(temperature=0, logprobs=1)])[1]
    assert mixed is not None and mixed[0] is None and mixed[1] is not None


def test_a_mixed_batch_penalises_each_row_as_alone() -> None:
    logits = logits_rows(4, 25, seed=6)
    fields: list[dict[str, float]] = [{"repetition_penalty": 1.5}, {"frequency_penalty": 0.7},
                                      {}, {"presence_penalty": -0.5, "repetition_penalty": 0.8}]
    seqs = [[1, 2, 3, 3, 9], [4, 4, 5, 6], [7, 8], [1, 1, 24, 24, 24]]

    def reqs(rows: list[int]) -> list[SampleRequest]:
        return [SampleRequest(SamplingParams(**fields[r]), 0, len(seqs[r]),  # type: ignore[arg-type]
                              history=history(list(seqs[r]), 2)) for r in rows]  # type: ignore[arg-type]

    together = processed(logits, reqs([0, 1, 2, 3]))
    for r in range(4):
        torch.testing.assert_close(together[r:r + 1], processed(logits[r:r + 1], reqs([r])))
    assert torch.equal(together[2], logits[2])


def one_row_reference(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """vLLM's order on one row: top-k on the logits, then top-p on the
    renormalised probabilities, then min-p; full sorts, nothing shared."""
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.sort(descending=True).values[params.top_k - 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, -1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        above = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order[above >= params.top_p]] = True
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def test_batched_filters_match_the_textbook_on_a_large_vocabulary() -> None:
    """Candidates decide peaked rows; flat rows (a nucleus past the candidates)
    fall back to a full sort; rows with other filters share the batch."""
    from mpexec.models.sampler import CANDIDATES, filter_rows

    vocab = 3 * CANDIDATES
    generator = torch.Generator().manual_seed(9)
    peaked = torch.randn(vocab, generator=generator) * 6
    flat = torch.randn(vocab, generator=generator) * 0.3
    rows = [(peaked, dict(temperature=1.0, top_p=0.9)),
            (flat, dict(temperature=1.0, top_p=0.9)),
            (peaked, dict(temperature=0.7, top_k=50)),
            (flat, dict(temperature=1.0, top_k=2000, top_p=0.95)),
            (flat, dict(temperature=1.0)),
            (peaked, dict(temperature=1.2, min_p=0.01, top_p=0.5))]
    params = [SamplingParams(**p) for _, p in rows]  # type: ignore[arg-type]
    scaled = torch.stack([logits / p.temperature for (logits, _), p in zip(rows, params,
                                                                             strict=True)])
    got = filter_rows(scaled, params)
    for i, (row, p) in enumerate(zip(scaled, params, strict=True)):
        want = one_row_reference(row, p)
        assert torch.equal(got[i] > 0, want > 0), i  # the same support
        torch.testing.assert_close(got[i] / got[i].sum(), want, atol=1e-6, rtol=1e-4)
    assert int((got[1] > 0).sum()) > CANDIDATES  # the flat row really fell back
