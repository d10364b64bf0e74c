"""The MAC of a large frame's bytes (mpexec.ipc.auth): keyed BLAKE3 under the
header's HMAC, exactly as documented; a flipped byte, another key or a
flipped algorithm flag is refused; without the blake3 package an end seals
with SHA-256, which every end opens, and refuses BLAKE3 frames it cannot
check, saying why.  No sockets: the frames are opened as a receiver would."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
from typing import Any

import pytest

from mpexec.ipc import auth
from mpexec.ipc.auth import DATA, HEADER, PREFIX, DropCounter, FrameAuth, derive_key

SECRET = "a-test-cluster-secret-0123456789"
KEY = derive_key(SECRET, "mq/test", "w2r")
BIG = os.urandom(300_000)  # larger than INLINE_BYTES: a frame of its own


def sealed(fauth: FrameAuth, parts: list[Any] | None = None) -> list[bytes]:
    frames = fauth.seal(DATA, 2, 9, parts if parts is not None else [b"json", BIG], aux=4)
    return [bytes(frame) for frame in frames]


def opened(fauth: FrameAuth, frames: list[bytes]) -> tuple[Any, DropCounter]:
    drops = DropCounter("test")
    return fauth.open(frames, drops), drops


@pytest.fixture
def no_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "_blake3", None)


def test_a_large_frame_is_hmac_of_the_header_and_the_keyed_blake3_of_its_parts() -> None:
    blake3 = pytest.importorskip("blake3").blake3
    first, data = sealed(FrameAuth(KEY, 1 << 30))
    header, mac = first[:HEADER.size], first[HEADER.size:PREFIX]
    flags = header[5]
    assert flags == 3  # part 0 inline, BLAKE3 body
    body_key = blake3(KEY, derive_key_context="mpexec/1 frame body").digest()
    assert body_key != KEY
    body = blake3(key=body_key)
    for part in (b"json", BIG):
        body.update(struct.pack("<Q", len(part)) + part)
    assert mac == hmac.new(KEY, header + body.digest(), hashlib.sha256).digest()
    assert first[PREFIX:] == b"json" and data == BIG
    frame, drops = opened(FrameAuth(KEY, 1 << 30), [first, data])
    assert frame is not None and not drops.total
    assert (frame.rank, frame.seq, frame.aux) == (2, 9, 4)
    assert [bytes(p) for p in frame.parts] == [b"json", BIG]


@pytest.mark.parametrize("where", ["first byte", "middle byte", "last byte", "inline part"])
def test_one_flipped_byte_is_refused(where: str) -> None:
    pytest.importorskip("blake3")
    first, data = sealed(FrameAuth(KEY, 1 << 30))
    if where == "inline part":
        first = first[:-1] + bytes([first[-1] ^ 1])
    else:
        at = {"first byte": 0, "middle byte": len(data) // 2, "last byte": len(data) - 1}[where]
        data = data[:at] + bytes([data[at] ^ 0x80]) + data[at + 1:]
    frame, drops = opened(FrameAuth(KEY, 1 << 30), [first, data])
    assert frame is None and drops.by_reason == {"bad mac": 1}


def test_a_frame_under_another_key_or_with_its_flag_flipped_is_refused() -> None:
    pytest.importorskip("blake3")
    other = derive_key("another-secret-0123456789abcdef", "mq/test", "w2r")
    for key in (other, derive_key(SECRET, "mq/test", "r2w"), derive_key(SECRET, "mq/x", "w2r")):
        frame, drops = opened(FrameAuth(KEY, 1 << 30), sealed(FrameAuth(key, 1 << 30)))
        assert frame is None and drops.by_reason == {"bad mac": 1}
    first, data = sealed(FrameAuth(KEY, 1 << 30))
    as_sha = first[:5] + bytes([first[5] & ~2]) + first[6:]  # claims a SHA-256 body
    frame, drops = opened(FrameAuth(KEY, 1 << 30), [as_sha, data])
    assert frame is None and drops.by_reason == {"bad mac": 1}


def test_parts_of_any_buffer_type_hash_as_their_bytes() -> None:
    array = pytest.importorskip("numpy").arange(100_000, dtype="float32")
    fauth = FrameAuth(KEY, 1 << 30)
    as_array = fauth.seal(DATA, 0, 1, [b"j", array])
    as_bytes = fauth.seal(DATA, 0, 1, [b"j", array.tobytes()])
    assert bytes(as_array[0]) == bytes(as_bytes[0])
    frame, drops = opened(fauth, [bytes(f) for f in as_array])
    assert frame is not None and not drops.total and bytes(frame.parts[1]) == array.tobytes()


def test_without_blake3_frames_are_sha256_and_still_open_everywhere(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    pytest.importorskip("blake3")
    fast = FrameAuth(KEY, 1 << 30)
    fast_frames = sealed(fast)
    monkeypatch.setattr(auth, "_blake3", None)
    auth._warn_no_blake3.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mpexec.ipc.auth"):
        slow = FrameAuth(KEY, 1 << 30)
        FrameAuth(KEY, 1 << 30)
    assert [r.getMessage() for r in caplog.records if "blake3" in r.getMessage()] == [
        "the blake3 package is not installed: large frames are authenticated with SHA-256 "
        "(about 5x slower) and frames from hosts that have it are dropped; install it "
        "(pip install 'mpexec[multinode]') on every host"]
    first, data = sealed(slow)
    header = first[:HEADER.size]
    assert header[5] == 1  # inline part, SHA-256 body
    digest = hashlib.sha256(struct.pack("<Q", 4) + b"json"
                            + struct.pack("<Q", len(BIG)) + BIG).digest()
    assert first[HEADER.size:PREFIX] == hmac.new(KEY, header + digest, hashlib.sha256).digest()
    for receiver in (slow, fast):
        frame, drops = opened(receiver, [first, data])
        assert frame is not None and bytes(frame.parts[1]) == BIG and not drops.total
    tampered = data[:-1] + bytes([data[-1] ^ 1])
    frame, drops = opened(fast, [first, tampered])
    assert frame is None and drops.by_reason == {"bad mac": 1}
    # a BLAKE3 frame cannot be checked here: refused, and the reason says why
    frame, drops = opened(slow, fast_frames)
    assert frame is None
    assert drops.by_reason == {"blake3 not installed here (pip install blake3)": 1}
    auth._warn_no_blake3.cache_clear()


def test_small_and_empty_messages_keep_their_forms(no_blake3: None) -> None:
    # one small part: MACed directly; no part: the fixed empty digest (no body hash)
    fauth = FrameAuth(KEY, 1 << 30)
    (small,) = fauth.seal(DATA, 0, 1, [b"small"])
    assert small[PREFIX:] == b"small" and small[5] == 1
    (empty,) = fauth.seal(DATA, 0, 1, [])
    assert len(empty) == PREFIX and empty[5] == 0
    for frame in (small, empty):
        assert opened(fauth, [frame])[0] is not None
