"""Round trips of the frame encoding, including out-of-band buffers."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from mpexec.ipc import serialization
from mpexec.ipc.serialization import ALIGN, Encoder, decode, dumps, loads

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=50), st.binary(max_size=300))
arrays = hnp.arrays(dtype=st.sampled_from([np.uint8, np.int32, np.float64, np.complex64]),
                    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=20))
values = st.recursive(scalars | arrays,
                      lambda children: st.lists(children, max_size=5)
                      | st.dictionaries(st.text(max_size=5), children, max_size=5)
                      | st.tuples(children, children), max_leaves=20)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=200, deadline=None)
@given(values)
def test_round_trip(value: Any) -> None:
    assert same(loads(bytearray(dumps(value))), value)


@settings(max_examples=50, deadline=None)
@given(st.lists(values, min_size=1, max_size=5))
def test_one_encoder_reused_for_many_messages(messages: list[Any]) -> None:
    encoder = Encoder()
    for message in messages:
        frame = encoder.encode(message)
        out = bytearray(frame.nbytes)
        serialization.write_into(frame, memoryview(out))
        assert same(decode(memoryview(out)), message)


def test_large_buffers_travel_out_of_band_and_aligned() -> None:
    array = np.arange(10_000, dtype=np.float64)
    frame = Encoder().encode({"a": array, "b": pickle.PickleBuffer(bytearray(b"x" * 5000))})
    assert len(frame.buffers) == 2
    assert all(offset % ALIGN == 0 for offset in frame.buffer_offsets)
    assert frame.pickle_len < 500  # the array's bytes are not in the pickle stream


def test_arrays_are_writable_views_of_the_frame() -> None:
    data = bytearray(dumps(np.zeros(1000)))
    array = loads(data)
    assert array.flags.writeable
    array[0] = 7.0
    assert loads(data)[0] == 7.0  # shares memory with the frame: zero copy


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_large_bytes_is_not_copied_into_the_pickle_stream(kind: type) -> None:
    big = kind(b"q" * (1 << 20))
    frame = Encoder().encode(("m", big))
    # The pickler hands the object itself to our sink: the one copy is ours.
    assert any(piece is big or (isinstance(piece, memoryview) and piece.obj is big)
               for piece in frame.pieces)
    assert loads(bytearray(dumps(("m", big)))) == ("m", big)


def test_memoryview_and_non_contiguous_buffers() -> None:
    mv = memoryview(bytearray(b"abcdef"))
    assert bytes(loads(bytearray(dumps(mv)))) == b"abcdef"
    strided = np.arange(100).reshape(10, 10)[:, ::3]
    assert np.array_equal(loads(bytearray(dumps(strided))), strided)
    strided_view = memoryview(np.arange(10, dtype=np.uint8))[::2]
    assert bytes(loads(bytearray(dumps(strided_view)))) == bytes(range(0, 10, 2))


def test_unpicklable_raises_and_encoder_stays_usable() -> None:
    encoder = Encoder()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        encoder.encode(("x", lambda: 1))
    frame = encoder.encode(("ok", 1))
    out = bytearray(frame.nbytes)
    serialization.write_into(frame, memoryview(out))
    assert decode(memoryview(out)) == ("ok", 1)


@pytest.mark.torch
def test_torch_cpu_tensors_travel_out_of_band() -> None:
    torch = pytest.importorskip("torch")
    tensors = {
        "f32": torch.arange(1000, dtype=torch.float32).reshape(10, 100),
        "bf16": torch.ones(64, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "strided": torch.arange(100).reshape(10, 10).t(),
        "bool": torch.tensor([True, False]),
    }
    frame = Encoder().encode(tensors)
    assert len(frame.buffers) >= 4
    back = loads(bytearray(dumps(tensors)))
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and back[key].shape == tensor.shape
        assert torch.equal(back[key], tensor), key
    grad = torch.ones(3, requires_grad=True)
    assert torch.equal(loads(bytearray(dumps(grad))), grad)


@pytest.mark.torch
def test_lazy_views_and_parameters_keep_what_they_are() -> None:
    """A conjugate or negative view goes through torch's own reducer (the fast
    path would need its bytes resolved); a Parameter arrives as a Parameter
    with its requires_grad, through the fast path."""
    torch = pytest.importorskip("torch")
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    neg = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag
    assert conj.is_conj() and neg.is_neg()
    for tensor in (conj, neg):
        back = loads(bytearray(dumps(tensor)))
        assert torch.equal(back, tensor)
    for requires_grad in (False, True):
        param = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3), requires_grad=requires_grad)
        frame = Encoder().encode(param)
        assert len(frame.buffers) == 1  # out of band: not torch's in-band storage pickle
        back = loads(bytearray(dumps(param)))
        assert type(back) is torch.nn.Parameter
        assert back.requires_grad is requires_grad and torch.equal(back.detach(), param.detach())


def test_bytearray_arrives_as_its_own_copy() -> None:
    """A bytearray owns its memory, so it cannot be a view of the frame: it
    arrives as a bytearray, copied out once (arrays and tensors are the views;
    the copy in is tested above)."""
    data = bytearray(b"q" * 100_000)
    wire = bytearray(dumps(data))
    back = loads(wire)
    assert type(back) is bytearray and back == data
    back[0] = 0
    assert wire.count(b"q") == 100_000  # the frame was not written through


def test_large_bytes_travel_as_blobs_and_arrive_as_bytes() -> None:
    from mpexec.ipc.serialization import BLOB_MIN

    big = bytes(range(256)) * (BLOB_MIN // 256 + 1)
    message = {"a": big, "again": big, "small": b"s" * 1000, "n": 3}
    frame = Encoder().encode(message)
    assert frame.n_blobs == 1   # the same object twice is one blob
    assert any(buf.obj is big for buf in frame.buffers)   # not copied on the way in
    back = loads(bytearray(dumps(message)))
    assert back == message and type(back["a"]) is bytes
    assert back["a"] is back["again"]   # identity within the message is kept


def test_bytes_from_copies_exactly_whatever_the_view() -> None:
    from mpexec.ipc.hugebytes import bytes_from

    data = bytearray(range(256)) * (24 << 12)   # 6 MiB: large enough for huge pages
    for view in (memoryview(data), memoryview(data)[7:-5], memoryview(bytes(data)),
                 memoryview(data)[:100]):
        out = bytes_from(view)
        assert type(out) is bytes and out == view.tobytes()
