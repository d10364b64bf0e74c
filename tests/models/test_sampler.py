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
    torch.testing.assert_close(torch.tensor(logprobs), expected)


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
            assert logprobs is not None and logprobs[1] == pytest.approx(0.0, abs=1e-6)


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
