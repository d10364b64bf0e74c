"""Turning objects into frames and back: pickle protocol 5 with buffers out of band.

``encode(obj)`` pickles once and returns a :class:`Frame`: the pickle stream as
a list of pieces plus the raw memory of every large buffer in the object
(numpy arrays, ``memoryview``, ``PickleBuffer``, and torch CPU tensors when
torch is loaded).  Nothing is joined or copied here: the queue copies each
piece exactly once, into shared memory.  A large ``bytes`` or ``bytearray``
cannot leave the pickle stream through pickle's own out-of-band channel, but
the pickler hands it to our sink as the original object, so it too is copied
only once on the way in.

On the way out, buffers are views of the frame (zero copies), while a
``bytes`` or ``bytearray`` must own its memory and is copied once.  For a
``bytes`` of at least ``BLOB_MIN`` that copy would mostly be page faults on
the freshly allocated object, so such objects travel as *blobs*: the message
is pickled a second time with a ``persistent_id`` that takes them out of the
stream (only messages that hold one pay for it), and the reader builds each
with :func:`~mpexec.ipc.hugebytes.bytes_from`, in huge pages.

Layout of an encoded frame, as written into a chunk or a bulk segment::

    u64 pickle_len | u64 n_buffers | u64 n_blobs | (n_buffers + n_blobs) x u64 length
    | pickle bytes | buffer 0 (64-byte aligned) | ... | blob 0 (aligned) | ...

``decode(view)`` reads that layout back from any buffer and unpickles with the
buffers as slices of it, so the reader's objects *are* the frame's memory:
the caller decides whether that memory is a private copy.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

from mpexec.ipc.hugebytes import bytes_from

ALIGN = 64
_U64 = struct.Struct("<Q")
_HEAD = struct.Struct("<QQQ")
# A bytes object at least this large travels as a blob (see module doc).
BLOB_MIN = 4 << 20


def _align(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


class Frame:
    """One encoded object: pickle pieces and out-of-band buffers, uncopied."""

    __slots__ = ("header", "pieces", "pickle_len", "buffers", "buffer_offsets", "nbytes",
                 "n_blobs")

    def __init__(self, header: bytes, pieces: list[Any], pickle_len: int,
                 buffers: list[memoryview], buffer_offsets: list[int], nbytes: int,
                 n_blobs: int = 0) -> None:
        self.n_blobs = n_blobs     # the last n_blobs of ``buffers`` are large bytes
        self.header = header
        self.pieces = pieces
        self.pickle_len = pickle_len
        self.buffers = buffers
        self.buffer_offsets = buffer_offsets
        self.nbytes = nbytes


class EncodedMessage:
    """A message pickled once (``MessageQueueWriter.encode``), ready to enqueue.

    ``data`` is the bare pickle (small, no out-of-band buffers) or a
    :class:`Frame` that still refers to the original object's buffers.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes | Frame) -> None:
        self.data = data

    @property
    def nbytes(self) -> int:
        data = self.data
        return len(data) if isinstance(data, bytes) else data.nbytes


class _Sink:
    """A file for ``pickle.Pickler``: keeps every piece it is given, uncopied."""

    __slots__ = ("write",)

    def __init__(self, pieces: list[Any]) -> None:
        self.write = pieces.append


def _rebuild_memoryview(buf: Any) -> memoryview:
    return memoryview(buf)


def _reduce_memoryview(view: memoryview) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if view.contiguous:
        return _rebuild_memoryview, (pickle.PickleBuffer(view.cast("B")),)
    return _rebuild_memoryview, (view.tobytes(),)


def _rebuild_tensor(buf: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    if len(memoryview(buf)) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _rebuild_parameter(buf: Any, dtype: Any, shape: tuple[int, ...],
                       requires_grad: bool) -> Any:
    import torch

    return torch.nn.Parameter(_rebuild_tensor(buf, dtype, shape), requires_grad=requires_grad)


def _fast_path_refuses(tensor: Any, is_parameter: bool) -> bool:
    """Tensors whose bytes alone do not say what they are keep torch's reducer:
    other devices, sparse/quantized/nested layouts, conjugate or negative
    views (a lazy bit, not data), and autograd history (a Parameter is a leaf:
    its ``requires_grad`` travels with it)."""
    return (tensor.device.type != "cpu" or tensor.is_sparse or tensor.is_quantized
            or tensor.is_nested or tensor.is_conj() or tensor.is_neg()
            or (tensor.requires_grad and not is_parameter))


def _reduce_tensor(tensor: Any) -> Any:
    import torch

    is_parameter = type(tensor) is torch.nn.Parameter
    if _fast_path_refuses(tensor, is_parameter):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    try:
        dense = tensor.detach().contiguous()
        if dense.numel() == 0:
            data = pickle.PickleBuffer(b"")
        else:
            data = pickle.PickleBuffer(dense.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError):  # a kind of tensor this path does not know yet
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if is_parameter:
        return _rebuild_parameter, (data, dense.dtype, tuple(dense.shape),
                                    bool(tensor.requires_grad))
    return _rebuild_tensor, (data, dense.dtype, tuple(dense.shape))


_tables: dict[bool, dict[Any, Any]] = {}


def _dispatch_table() -> dict[Any, Any]:
    torch_loaded = "torch" in sys.modules
    table = _tables.get(torch_loaded)
    if table is None:
        table = dict(copyreg.dispatch_table)
        table[memoryview] = _reduce_memoryview
        if torch_loaded:
            torch = sys.modules["torch"]
            table[torch.Tensor] = _reduce_tensor
            table[torch.nn.Parameter] = _reduce_tensor
        _tables[torch_loaded] = table
    return table


def _nbytes(piece: Any) -> int:
    return len(piece) if isinstance(piece, bytes) else memoryview(piece).nbytes


class Encoder:
    """Reusable pickler state for one writer thread (not thread-safe).

    Building a ``Pickler`` costs more than pickling a small message, so each
    queue keeps one and resets it between messages.
    """

    def __init__(self) -> None:
        self._pieces: list[Any] = []
        self._buffers: list[pickle.PickleBuffer] = []
        self._torch_loaded = "torch" in sys.modules
        self._pickler = self._new_pickler()

    def _new_pickler(self) -> pickle.Pickler:
        pickler = pickle.Pickler(_Sink(self._pieces), protocol=5,
                                 buffer_callback=self._buffers.append)
        pickler.dispatch_table = _dispatch_table()
        return pickler

    def encode(self, obj: Any) -> Frame:
        """Pickle ``obj`` into a :class:`Frame`; the pickling error propagates."""
        data = self.dump(obj)
        return frame_of(data) if data.__class__ is bytes else data  # type: ignore[return-value]

    def dump(self, obj: Any) -> bytes | Frame:
        """Pickle ``obj``: the pickle itself when it is one piece with no
        out-of-band buffer (the common, small case), else a :class:`Frame`."""
        if self._torch_loaded is not ("torch" in sys.modules):
            self._torch_loaded = not self._torch_loaded
            self._pickler = self._new_pickler()
        pieces = self._pieces
        pickler = self._pickler
        pickler.clear_memo()
        try:
            pickler.dump(obj)
        except BaseException:
            pieces.clear()
            self._buffers.clear()
            raise
        if len(pieces) == 1 and not self._buffers:
            data = pieces.pop()
            if data.__class__ is bytes:
                return data
            pieces.append(data)
        # Producers of PickleBuffer (numpy, our reducers) only make them for
        # contiguous memory, so raw() cannot fail here.
        buffers = [buf.raw() for buf in self._buffers]
        self._buffers.clear()
        out_pieces = pieces[:]
        pieces.clear()
        if any(p.__class__ is bytes and len(p) >= BLOB_MIN for p in out_pieces[1:]):
            return self._dump_with_blobs(obj)
        return _frame(out_pieces, buffers)

    def _dump_with_blobs(self, obj: Any) -> Frame:
        """Pickle again, large ``bytes`` taken out as blobs (rare: a few MiB of
        bytes in the message; the first pickle kept them as they were)."""
        pieces: list[Any] = []
        buffers: list[pickle.PickleBuffer] = []
        blobs: list[bytes] = []
        pickler = _BlobPickler(_Sink(pieces), blobs, buffers.append)
        pickler.dispatch_table = _dispatch_table()
        pickler.dump(obj)
        views = [buf.raw() for buf in buffers] + [memoryview(blob) for blob in blobs]
        return _frame(pieces, views, n_blobs=len(blobs))


class _BlobPickler(pickle.Pickler):
    """Takes every ``bytes`` of at least BLOB_MIN out of the stream, by identity."""

    def __init__(self, sink: _Sink, blobs: list[bytes],
                 buffer_callback: Callable[[pickle.PickleBuffer], None]) -> None:
        super().__init__(sink, protocol=5, buffer_callback=buffer_callback)
        self._blobs = blobs
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if obj.__class__ is not bytes or len(obj) < BLOB_MIN:
            return None
        index = self._index.get(id(obj))
        if index is None:
            index = self._index[id(obj)] = len(self._blobs)
            self._blobs.append(obj)
        return index


def _frame(pieces: list[Any], buffers: list[memoryview], n_blobs: int = 0) -> Frame:
    pickle_len = sum(_nbytes(piece) for piece in pieces)
    header = _HEAD.pack(pickle_len, len(buffers) - n_blobs, n_blobs) + b"".join(
        _U64.pack(buf.nbytes) for buf in buffers)
    offsets = []
    end = len(header) + pickle_len
    for buf in buffers:
        start = _align(end)
        offsets.append(start)
        end = start + buf.nbytes
    return Frame(header, pieces, pickle_len, buffers, offsets, end, n_blobs)


def frame_of(data: bytes) -> Frame:
    """The frame of a plain pickle (no out-of-band buffers)."""
    return _frame([data], [])


def encode(obj: Any) -> Frame:
    """Pickle ``obj`` with a fresh :class:`Encoder`."""
    return Encoder().encode(obj)


def write_into(frame: Frame, target: memoryview) -> None:
    """Copy ``frame`` into ``target`` (a writable byte view of >= nbytes)."""
    pos = len(frame.header)
    target[:pos] = frame.header
    for piece in frame.pieces:
        size = _nbytes(piece)
        target[pos:pos + size] = piece
        pos += size
    for start, buf in zip(frame.buffer_offsets, frame.buffers, strict=True):
        target[start:start + buf.nbytes] = buf


def iter_pieces(frame: Frame) -> list[Any]:
    """The frame as consecutive byte pieces, alignment gaps included (for writev)."""
    out: list[Any] = [frame.header, *frame.pieces]
    end = len(frame.header) + frame.pickle_len
    for start, buf in zip(frame.buffer_offsets, frame.buffers, strict=True):
        if start > end:
            out.append(bytes(start - end))
        out.append(buf)
        end = start + buf.nbytes
    return out


def decode(view: memoryview) -> Any:
    """Unpickle a frame from ``view``; out-of-band buffers become slices of it,
    blobs become ``bytes`` copied out of it."""
    pickle_len, n_buffers, n_blobs = _HEAD.unpack_from(view, 0)
    pos = _HEAD.size
    lengths = [_U64.unpack_from(view, pos + 8 * i)[0] for i in range(n_buffers + n_blobs)]
    pos += 8 * len(lengths)
    data = view[pos:pos + pickle_len]
    end = pos + pickle_len
    buffers = []
    for length in lengths:
        start = _align(end)
        buffers.append(view[start:start + length])
        end = start + length
    if not n_blobs:
        return pickle.loads(data, buffers=buffers)
    blobs = buffers[n_buffers:]
    made: dict[int, bytes] = {}

    def load_blob(index: int) -> bytes:
        blob = made.get(index)
        if blob is None:
            blob = made[index] = bytes_from(blobs[index])
        return blob

    unpickler = pickle.Unpickler(io.BytesIO(data), buffers=buffers[:n_buffers])
    unpickler.persistent_load = load_blob  # type: ignore[method-assign]
    return unpickler.load()


def dumps(obj: Any) -> bytes:
    """``encode`` + join: a frame as one ``bytes`` (tests, small messages)."""
    frame = encode(obj)
    out = bytearray(frame.nbytes)
    write_into(frame, memoryview(out))
    return bytes(out)


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of :func:`dumps`; buffers of ``bytearray`` input stay writable."""
    return decode(memoryview(data))
