"""Authenticated frames between hosts: HMAC-SHA256 over a per-cluster secret,
the bulk of a large message through keyed BLAKE3.

Everything a remote queue end (``remote``), a node's control channel
(``mpexec.executor.node``) or a KV peer (``peer_wire``) sends across the
network is one ZeroMQ message of frames::

    frame 0: header | mac [| part 0 when it is small]   frame 1..: the other parts

    header  = magic "MPX1", kind (u8), flags (u8), rank (u32), aux (u32),
              seq (u64), n_parts (u32), body_len (u64)      (fixed 36 bytes)
    mac     = HMAC-SHA256(key, header || part 0)      one part, inline (a small message)
            = HMAC-SHA256(key, header || body)         otherwise, where
    body    = BLAKE3-keyed(body_key, u64 len || part, for each part)   flags & BLAKE3
            = SHA-256(u64 len || part, for each part)                  otherwise
    key      = HMAC-SHA256(secret, "mpexec/1/" || channel || "/" || direction)
    body_key = BLAKE3-derive-key("mpexec/1 frame body", key)

The key is derived per channel (a queue's random token, a node control
session) and per direction, so a frame can be replayed neither into another
queue nor back at its sender; ``rank`` is covered, so a frame meant for one
reader cannot be fed to another; ``seq`` is checked by the receiver against
the next number it expects, so an old frame is a replay.  A message of
several parts, or a large one, is hashed once and the 32-byte result is
MACed with the header: a message to many readers hashes its bytes once.  A
small single part is MACed directly with the header (one pass, no digest);
the header is of fixed size and says which form applies (``flags``,
``n_parts``), so the forms cannot be confused.

Why two algorithms.  The bytes of a large message (a KV cache streamed
between instances, a big call) are hashed by the sender and again by the
receiver, and one core computes SHA-256 at about 1 GB/s, slower than
ZeroMQ moves bytes on loopback; keyed BLAKE3 (a PRF, so a MAC on its own,
no nonce) runs at about 5 GB/s.  Its key is derived from the channel key in
BLAKE3's own key-derivation mode, so no key serves two algorithms
directly.  The header's ``BLAKE3`` flag (under the HMAC, so it cannot be
flipped) says which body hash the sender used.  BLAKE3 comes from the
``blake3`` package (the ``multinode`` extra); a process without it seals
with SHA-256, which every end still opens, and drops the BLAKE3 frames it
cannot check with the reason ``"blake3 not installed here"`` (the
fallback itself is logged once, with the fix): a cluster that mixes hosts
with and without it fails loudly, never accepting an unchecked byte, until
every host has it.

:meth:`FrameAuth.open` checks the structure (frame count, header size,
declared lengths, the size limit) and then the MAC with
``hmac.compare_digest`` - *before* anything is deserialised - and returns
``None`` for anything that fails; :class:`DropCounter` counts every drop by
reason and logs them at most once per ``log_interval_s``.

The hot path of a queue (one small message, one reader) has two shortcuts
that produce and accept exactly the frames described above, nothing else:
:meth:`FrameAuth.seal_small` (one part inline) and :meth:`FrameAuth.seal_control`
(no part: the digest of nothing is computed once), and
:meth:`FrameAuth.open_expected`, which accepts a frame only when its header is
byte for byte the one the receiver expects next (kind, rank, sequence number,
one inline part) and its MAC verifies; anything else is left to
:meth:`FrameAuth.open`, which counts it.

The secret comes from the configuration, else ``MPEXEC_CLUSTER_SECRET``,
else :func:`generate_secret` on the leader, which hands it to its local
workers and is printed for the operator to give to followers.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib
import logging
import secrets
import struct
import time
from collections import Counter
from typing import Any, NamedTuple

from mpexec.errors import MpexecError

logger = logging.getLogger(__name__)

MAGIC = b"MPX1"
HEADER = struct.Struct("<4sBBxxIIQIQ")
assert HEADER.size == 36
MAC_BYTES = 32
PREFIX = HEADER.size + MAC_BYTES
MIN_SECRET_BYTES = 16
# A first part up to this size travels inside the first frame (one ZeroMQ
# frame for a small message); larger parts are frames of their own, uncopied.
INLINE_BYTES = 64 * 1024
_INLINE = 1
_BLAKE3 = 2  # the body is hashed with keyed BLAKE3 (else SHA-256)
BODY_CONTEXT = "mpexec/1 frame body"  # BLAKE3 derive-key context for body_key
_LEN = struct.Struct("<Q")
_EMPTY_DIGEST = hashlib.sha256().digest()  # the body digest of a frame with no part
_pack = HEADER.pack
_compare = hmac.compare_digest

# SHA-256 for the MACs: CPython's own implementation where it has one (its
# copy() is a plain struct copy; OpenSSL 3's allocates and dispatches through
# its providers, which costs more than hashing a small frame), else hashlib's.
def _builtin_sha256() -> Any:
    for module in ("_sha256", "_sha2"):  # CPython <= 3.11, >= 3.12
        try:
            return importlib.import_module(module).sha256
        except (ImportError, AttributeError):  # pragma: no cover - depends on the Python
            continue
    return hashlib.sha256  # pragma: no cover


_sha256 = _builtin_sha256()


def _import_blake3() -> Any:
    try:
        from blake3 import blake3
    except ImportError:
        return None
    return blake3


# None where the package is missing: SHA-256 bodies (see the module docstring).
_blake3 = _import_blake3()


def _hmac_states(key: bytes) -> tuple[Any, Any]:
    """HMAC-SHA256 (RFC 2104) keyed once: the SHA-256 states after the inner
    and the outer padded key; a MAC is ``outer(inner(message))`` from copies."""
    block = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
    return (_sha256(bytes(b ^ 0x36 for b in block)),
            _sha256(bytes(b ^ 0x5C for b in block)))


# Frame kinds (queues and the node control channel share the numbering).
HELLO, WELCOME, DATA, ACK, CLOSE, RESUME = 1, 2, 3, 4, 5, 6
JOIN, CONFIG, READY, PING, FAILED, BYE = 10, 11, 12, 13, 14, 15

# Not authenticated (the two ends do not share a key): a refusal carries
# only this marker and a fixed reason code, never anything to decode.
REFUSED = b"MPX1-REFUSED"


class AuthenticationError(MpexecError, PermissionError):
    """The other end does not hold the same cluster secret (or sent forged frames)."""


def generate_secret() -> str:
    """A fresh secret: 32 random bytes as 64 hex digits."""
    return secrets.token_hex(32)


def secret_bytes(secret: str | bytes) -> bytes:
    """The secret as bytes; shorter than 16 bytes is refused (``ValueError``)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"cluster secret must be at least {MIN_SECRET_BYTES} bytes, "
                         f"got {len(raw)}")
    return raw


def derive_key(secret: str | bytes, channel: str, direction: str) -> bytes:
    label = f"mpexec/1/{channel}/{direction}".encode()
    return hmac.new(secret_bytes(secret), label, hashlib.sha256).digest()


class Opened(NamedTuple):
    """A frame whose structure and MAC checked out (its seq is the receiver's to check)."""

    kind: int
    rank: int
    aux: int
    seq: int
    parts: list[Any]


def _nbytes(part: Any) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(memoryview(part).cast("B"))


class FrameAuth:
    """Seals and opens frames of one channel and direction."""

    def __init__(self, key: bytes, max_bytes: int) -> None:
        # Keyed once: each MAC copies the two states (cheaper than re-keying).
        self._inner, self._outer = _hmac_states(key)
        if self._mac(b"probe", b"") != hmac.new(key, b"probe", hashlib.sha256).digest():
            raise RuntimeError("SHA-256 states disagree with hmac")  # pragma: no cover
        self.max_bytes = max_bytes
        # The keyed BLAKE3 state for bodies (copied per message), or None: SHA-256 bodies.
        self._body: Any = None
        if _blake3 is not None:
            body_key = _blake3(key, derive_key_context=BODY_CONTEXT).digest()
            self._body = _blake3(key=body_key)
        else:
            _warn_no_blake3()

    def _mac(self, header: Any, body: Any) -> bytes:
        inner = self._inner.copy()
        inner.update(header)
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def seal_small(self, kind: int, rank: int, seq: int, part: bytes, aux: int = 0) -> bytes:
        """The one frame of a message of one small ``bytes`` part (<= INLINE_BYTES)."""
        header = _pack(MAGIC, kind, _INLINE, rank, aux, seq, 1, len(part))
        inner = self._inner.copy()
        inner.update(header)
        inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return header + outer.digest() + part

    def seal_control(self, kind: int, rank: int, seq: int, aux: int = 0) -> bytes:
        """The one frame of a message with no part (what ``seal(..., [])`` makes)."""
        header = _pack(MAGIC, kind, 0, rank, aux, seq, 0, 0)
        return header + self._mac(header, _EMPTY_DIGEST)

    def open_expected(self, first: bytes, kind: int, rank: int, seq: int,
                      aux: int) -> bytes | None:
        """The part of ``first`` if it is exactly the one-part inline frame
        (kind, rank, seq, aux) the receiver expects next and it is authentic;
        else ``None``, uncounted: the caller gives such frames to :meth:`open`."""
        body_len = len(first) - PREFIX
        if not 0 <= body_len <= INLINE_BYTES or body_len > self.max_bytes:
            return None
        header = _pack(MAGIC, kind, _INLINE, rank, aux, seq, 1, body_len)
        if not first.startswith(header):
            return None
        part = first[PREFIX:]  # small: a copy costs less than memoryviews
        inner = self._inner.copy()
        inner.update(header)
        inner.update(part)
        outer = self._outer.copy()
        outer.update(inner.digest())
        if not _compare(first[HEADER.size:PREFIX], outer.digest()):
            return None
        return part

    def open_control(self, frame: bytes) -> Opened | None:
        """``frame`` opened if it is an authentic frame with no part (an ACK, a
        RESUME); else ``None``, uncounted: the caller gives it to :meth:`open`."""
        if len(frame) != PREFIX:
            return None
        magic, kind, flags, rank, aux, seq, n_parts, body_len = HEADER.unpack_from(frame)
        if magic != MAGIC or flags or n_parts or body_len:
            return None
        if not _compare(frame[HEADER.size:], self._mac(frame[:HEADER.size], _EMPTY_DIGEST)):
            return None
        return Opened(kind, rank, aux, seq, [])

    def _digest(self, parts: list[Any], blake3: bool) -> tuple[bytes, int]:
        """The body hash of ``parts`` (keyed BLAKE3 or SHA-256) and their total size."""
        body = self._body.copy() if blake3 else hashlib.sha256()
        total = 0
        for part in parts:
            view = memoryview(part).cast("B")  # blake3 takes plain bytes views only
            total += view.nbytes
            body.update(_LEN.pack(view.nbytes))
            body.update(view)
        return body.digest(), total

    def seal(self, kind: int, rank: int, seq: int, parts: list[Any], aux: int = 0,
             ) -> list[Any]:
        """The frames to send: the sealed first frame, then the large parts."""
        if len(parts) == 1 and parts[0].__class__ is bytes and len(parts[0]) <= INLINE_BYTES:
            return [self.seal_small(kind, rank, seq, parts[0], aux)]  # one frame, one pass
        if not parts:
            return [self.seal_control(kind, rank, seq, aux)]
        firsts, rest = self.seal_many(kind, [rank], seq, parts, aux)
        return [firsts[0], *rest]

    def seal_many(self, kind: int, ranks: list[int], seq: int, parts: list[Any],
                  aux: int = 0) -> tuple[list[bytes], list[Any]]:
        """One first frame per rank for the same parts (hashed once), and the
        parts that follow it as frames of their own."""
        if len(parts) == 1 and _nbytes(parts[0]) <= INLINE_BYTES:
            part = bytes(parts[0])
            firsts = []
            for rank in ranks:
                header = HEADER.pack(MAGIC, kind, _INLINE, rank, aux, seq, 1, len(part))
                firsts.append(header + self._mac(header, part) + part)
            return firsts, []
        blake3 = self._body is not None
        digest, body_len = self._digest(parts, blake3)
        inline = bool(parts) and _nbytes(parts[0]) <= INLINE_BYTES
        flags = (_INLINE if inline else 0) | (_BLAKE3 if blake3 else 0)
        tail = bytes(parts[0]) if inline else b""
        firsts = []
        for rank in ranks:
            header = HEADER.pack(MAGIC, kind, flags, rank, aux, seq, len(parts), body_len)
            firsts.append(header + self._mac(header, digest) + tail)
        return firsts, list(parts[1:] if inline else parts)

    def open(self, frames: list[Any], drops: DropCounter) -> Opened | None:
        """The frame if it is well formed and authentic; else ``None`` (counted)."""
        if not frames:
            drops.drop("truncated")
            return None
        first = memoryview(frames[0]).cast("B")
        if len(first) < PREFIX:
            drops.drop("truncated")
            return None
        magic, kind, flags, rank, aux, seq, n_parts, body_len = HEADER.unpack_from(first)
        if magic != MAGIC or flags & ~(_INLINE | _BLAKE3):
            drops.drop("bad header")
            return None
        if body_len > self.max_bytes:
            drops.drop("oversized")
            return None
        header = first[:HEADER.size]
        mac = first[HEADER.size:PREFIX]
        if len(frames) == 1 and flags == _INLINE and n_parts == 1:
            # One small part inline: MACed directly (see the module docstring).
            part = first[PREFIX:]
            if part.nbytes != body_len:
                drops.drop("truncated")
                return None
            if not hmac.compare_digest(mac, self._mac(header, part)):
                drops.drop("bad mac")
                return None
            return Opened(kind, rank, aux, seq, [part])
        parts = [memoryview(f).cast("B") for f in frames[1:]]
        if flags & _INLINE:
            parts.insert(0, first[PREFIX:])
        elif len(first) != PREFIX:
            drops.drop("bad header")
            return None
        if n_parts != len(parts):
            drops.drop("bad header")
            return None
        if sum(p.nbytes for p in parts) != body_len:
            drops.drop("truncated")
            return None
        if n_parts == 1 and flags & _INLINE:
            drops.drop("bad header")  # that form is MACed directly, never as a digest
            return None
        blake3 = bool(flags & _BLAKE3)
        if blake3 and self._body is None:
            drops.drop("blake3 not installed here (pip install blake3)")
            return None
        digest = self._digest(parts, blake3)[0] if parts or blake3 else _EMPTY_DIGEST
        if not hmac.compare_digest(mac, self._mac(header, digest)):
            drops.drop("bad mac")
            return None
        return Opened(kind, rank, aux, seq, parts)


@functools.cache
def _warn_no_blake3() -> None:
    logger.warning("the blake3 package is not installed: large frames are authenticated "
                   "with SHA-256 (about 5x slower) and frames from hosts that have it are "
                   "dropped; install it (pip install 'mpexec[multinode]') on every host")


def kind_of(frames: list[Any]) -> int | None:
    """The kind a frame claims (unauthenticated: only to choose a refusal)."""
    if not frames or len(frames[0]) < PREFIX or bytes(frames[0][:4]) != MAGIC:
        return None
    return int(frames[0][4])


class DropCounter:
    """Frames dropped unopened, by reason; logged at most once per interval."""

    def __init__(self, what: str, log_interval_s: float = 5.0) -> None:
        self.what = what
        self.by_reason: Counter[str] = Counter()
        self._log_interval_s = log_interval_s
        self._last_log = -float("inf")
        self._logged_total = 0

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def drop(self, reason: str) -> None:
        self.by_reason[reason] += 1
        now = time.monotonic()
        if now - self._last_log >= self._log_interval_s:
            self._last_log = now
            total = self.total
            logger.warning("%s: dropped %d unauthenticated or replayed frame(s) since the "
                           "last report (%s)", self.what, total - self._logged_total,
                           ", ".join(f"{k}: {v}" for k, v in sorted(self.by_reason.items())))
            self._logged_total = total


def refusal(reason: str) -> list[bytes]:
    return [REFUSED, reason.encode()[:200]]


def is_refusal(frames: list[Any]) -> str | None:
    """The reason if ``frames`` is a refusal (plain text, never deserialised)."""
    if len(frames) == 2 and bytes(frames[0]) == REFUSED:
        return bytes(frames[1]).decode(errors="replace")
    return None
