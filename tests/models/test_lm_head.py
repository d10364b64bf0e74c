"""The LM head's argmax-only pass (``ParallelLMHead(..., argmax_only=True)``)
against the stored weights' exact logits, and when the sampler asks for it.

The pass estimates every logit from the top 4 bits of an 8-bit head's
values and re-scores exactly the rows that could be the argmax; its promise is the
argmax of the stored weights, not the other logits.  So these tests hold
the argmax (and the exact value there), on weights quantised to Q8_0 by
gguf, with inputs that have the outlier channels of real hidden states.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from tests.models.model_run_support import run_ranks  # noqa: E402

from mpexec.models.layers import embedding  # noqa: E402
from mpexec.models.layers.embedding import ParallelLMHead  # noqa: E402
from mpexec.models.layers.parallel import SingleRankGroup  # noqa: E402
from mpexec.models.layers.quantized import GroupRows, Int8GroupWeight  # noqa: E402
from mpexec.models.loader.quants import encoding_of, groups_of  # noqa: E402
from mpexec.models.sampler import SampleRequest, argmax_suffices  # noqa: E402
from mpexec.outputs import GuidedDecodingParams, SamplingParams  # noqa: E402

VOCAB, HIDDEN = 3000, 128


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def q8_0_head(rows: slice = slice(None)) -> tuple[ParallelLMHead, torch.Tensor]:
    """A Q8_0 head of VOCAB random rows (or ``rows`` of them) and its exact float32 values."""
    values = np.random.default_rng(0).standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    values *= np.random.default_rng(1).uniform(0.2, 2.0, (VOCAB, 1)).astype(np.float32)
    kind = gguf.GGMLQuantizationType.Q8_0
    encoding = encoding_of(int(kind))
    assert encoding is not None
    q, scale, minimum = (torch.from_numpy(a[rows]) for a in
                         groups_of(gguf.quants.quantize(values, kind), encoding))
    stored = GroupRows(q, scale, minimum)
    dense = stored.rows(torch.arange(len(q)), torch.float32)
    return ParallelLMHead(Int8GroupWeight(q, scale, minimum), SingleRankGroup(), stored), dense


def hidden_states(count: int) -> Any:
    """Rows like a final norm's output: mostly small, a few large channels."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(count, HIDDEN, generator=generator)
    x[:, [5, 77]] *= 12
    return x


def test_argmax_only_gives_the_stored_weights_argmax() -> None:
    head, dense = q8_0_head()
    assert head.widest_variance is not None
    x = hidden_states(200)
    exact = x.double() @ dense.double().T
    got = head(x, argmax_only=True)
    full = head(x)
    assert got.shape == full.shape == (200, VOCAB)
    picked = got.argmax(-1)
    assert torch.equal(picked, exact.argmax(-1))
    torch.testing.assert_close(got.gather(-1, picked[:, None]).double(),
                               exact.gather(-1, picked[:, None]), atol=1e-4, rtol=2e-6)
    # the other logits are estimates (the pass ran), within the error model's
    # bound: |error| <= 6 σ_v + |logit| / 128 (measured here: up to 4.6 σ_v)
    assert not torch.equal(got, full)
    squares = x.double().unflatten(-1, (-1, 32)).square().sum(-1)
    sigma = (squares @ head._low_variance(slice(None)).double().T).sqrt()
    assert ((got.double() - exact).abs() <= 6 * sigma + exact.abs() / 128).all()
    # each row on its own picks the same
    for row in (0, 57, 199):
        assert int(head(x[row:row + 1], argmax_only=True).argmax()) == int(picked[row])


def test_a_flat_row_takes_the_full_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """x = 0: every estimate ties, all rows are candidates; beyond
    MAX_CANDIDATES the head computes the low bits too."""
    head, _ = q8_0_head()
    monkeypatch.setattr(embedding, "MAX_CANDIDATES", 100)
    x = torch.cat([torch.zeros(1, HIDDEN), hidden_states(1)])
    torch.testing.assert_close(head(x, argmax_only=True), head(x), atol=0, rtol=0)


def test_argmax_only_at_tensor_parallel_2() -> None:
    """Each rank narrows its own rows; the gathered row's argmax is the whole head's."""
    x = hidden_states(40)
    _, dense = q8_0_head()
    want = (x.double() @ dense.double().T).argmax(-1)

    def rank(tp_rank: int, group: Any) -> Any:
        half = VOCAB // 2
        head, _ = q8_0_head(slice(tp_rank * half, (tp_rank + 1) * half))
        head.group = group
        return head(x, argmax_only=True).argmax(-1)

    for got in run_ranks(2, rank):
        assert torch.equal(got, want)


def test_a_float_head_ignores_argmax_only() -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(50, 64, generator=generator)
    head = ParallelLMHead(weight, SingleRankGroup())
    x = torch.randn(3, 64, generator=generator)
    assert head.widest_variance is None
    assert torch.equal(head(x, argmax_only=True), head(x))


def test_a_5_bit_head_estimates_from_its_top_4_bits() -> None:
    """Q5_0-like groups (q in 0..31) are cut at bit 1: the estimate misses
    one bit, and its argmax pass picks the stored weights' argmax too."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randint(0, 32, (VOCAB, HIDDEN), generator=generator, dtype=torch.uint8)
    scale = torch.rand(VOCAB, HIDDEN // 32, generator=generator) * 0.05 + 0.01
    weight = Int8GroupWeight(q, scale, -16 * scale)
    assert int(weight.low_bits.max()) == 1
    stored = GroupRows(q, scale, -16 * scale)
    head = ParallelLMHead(weight, SingleRankGroup(), stored)
    dense = stored.rows(torch.arange(VOCAB), torch.float32).double()
    x = hidden_states(50)
    got = head(x, argmax_only=True)
    assert torch.equal(got.argmax(-1), (x.double() @ dense.T).argmax(-1))
    assert not torch.equal(got, head(x))


@pytest.mark.parametrize(("params", "extra", "suffices"), [
    (SamplingParams(temperature=0), {}, True),
    (SamplingParams(temperature=0, min_tokens=2), {"num_output_tokens": 2}, True),
    (SamplingParams(temperature=0.7), {}, False),
    (SamplingParams(temperature=0, logprobs=0), {}, False),
    (SamplingParams(temperature=0, logit_bias={3: 1.0}), {}, False),
    (SamplingParams(temperature=0, repetition_penalty=1.2), {}, False),
    (SamplingParams(temperature=0, min_tokens=2), {"min_tokens_stop_ids": (2,)}, False),
    (SamplingParams(temperature=0, guided_decoding=GuidedDecodingParams(regex="a+")), {},
     False),
])
def test_the_sampler_says_when_the_argmax_suffices(params: SamplingParams, extra: dict[str, Any],
                                                   suffices: bool) -> None:
    plain = SampleRequest(SamplingParams(temperature=0), seed=0, position=0)
    request = SampleRequest(params, seed=0, position=5, **extra)
    assert argmax_suffices([plain, request]) is suffices
    assert argmax_suffices([plain])
