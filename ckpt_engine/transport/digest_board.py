"""Where an offered version's digests are posted once they are known: a small registered buffer of the lead
owner's, which its pullers read (the ``nixl`` transport).

A version is offered as soon as its snapshot is cached: pullers start reading its buckets while the lead still
digests them. Each puller reads this board when it first needs a bucket's digests, and again (backing off)
until they are posted. Nothing here trusts the order in which a remote read sees the owner's writes: a post is
valid only if its stamp, written last, is the hash of everything else and of the version it is for. A stale
post of another version (the board's memory is reused) and a post read half-written both fail that check and
read as "not yet". The lead posts a failure instead when the version cannot be verified, so its pullers stop
at once rather than at their deadline.

An owner posts its digests twice: *computed* as soon as its send has digested (and kept) its pieces, then
*final* once the owners voted that every one sent its share (and, the lead, once the daemon has its report).
Pullers check bytes against the computed ones and read what the owner kept once they are posted; they load
only once every owner's final post (the same digests) is there. With several owners the vote crosses links
the pulls fill, so the final post can come long after the computed one.

    [stamp u64][state u32][count u32][version i64][payload: count digests (i64) | count bytes of the reason]
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import xxhash

from ckpt_engine.errors import CacheError, ProtocolError

_HEAD = struct.Struct("<QIIq")
_READY, _FAILED, _COMPUTED = 1, 2, 3
REASON_BYTES = 1024  # a failure's reason is cut to this


def board_nbytes(pieces: int) -> int:
    """The board's size for a version of ``pieces`` pieces (room for a failure's reason too)."""
    return _HEAD.size + max(8 * pieces, REASON_BYTES)


def clear(board: torch.Tensor) -> None:
    """Nothing posted (a reused board's old post would read as another version's anyway)."""
    board[: _HEAD.size].zero_()


def post_digests(board: torch.Tensor, version: int, layout_digest: str, digests: Sequence[int],
                 final: bool = True) -> None:
    """Post every piece's digest, in wire order (int64 values, as the digests are computed): ``final``, or only
    computed (see above)."""
    try:
        payload = struct.pack(f"<{len(digests)}q", *digests)
    except struct.error as exc:
        raise CacheError(f"version {version}: a digest is not an int64: {exc}") from None
    _post(board, version, layout_digest, _READY if final else _COMPUTED, len(digests), payload)


def post_failure(board: torch.Tensor, version: int, layout_digest: str, reason: str) -> None:
    """Post that the version cannot be verified, and why: its pullers give up at once."""
    payload = reason.encode("utf-8", "replace")[:REASON_BYTES]
    _post(board, version, layout_digest, _FAILED, len(payload), payload)


def read_board(raw: bytes, version: int, layout_digest: str, pieces: int) -> list[int] | None:
    """The digests ``raw`` (a board as read) posts for ``version`` as final; None if none are yet."""
    post = read_post(raw, version, layout_digest, pieces)
    return post[0] if post is not None and post[1] else None


def read_post(raw: bytes, version: int, layout_digest: str, pieces: int) -> tuple[list[int], bool] | None:
    """The digests ``raw`` (a board as read) posts for ``version``, and whether they are final; None if nothing
    valid is posted for it yet. A ProtocolError if the owner posted that the version failed, or a digest count
    other than ``pieces``."""
    if len(raw) < _HEAD.size:
        return None
    stamp, state, count, posted = _HEAD.unpack_from(raw)
    size = count if state == _FAILED else 8 * count
    if stamp == 0 or posted != version or state not in (_READY, _FAILED, _COMPUTED):
        return None  # (a stamp of 0: cleared, the post being written)
    if _HEAD.size + size > len(raw):  # (this version's post, bigger than it can be: its owner is not ours)
        raise ProtocolError(f"version {version}: its owner's digest board claims {count} "
                            f"{'bytes of reason' if state == _FAILED else 'digests'}, more than it holds")
    if stamp != _stamp(raw[8 : _HEAD.size + size], layout_digest):
        return None
    payload = raw[_HEAD.size : _HEAD.size + size]
    if state == _FAILED:
        raise ProtocolError(f"version {version}: its owner gave up on it: {payload.decode('utf-8', 'replace')}")
    if count != pieces:
        raise ProtocolError(f"version {version}: its owner posted {count} digests for {pieces} pieces")
    return list(struct.unpack(f"<{count}q", payload)), state == _READY


def _post(board: torch.Tensor, version: int, layout_digest: str, state: int, count: int, payload: bytes) -> None:
    if _HEAD.size + len(payload) > board.numel():
        raise CacheError(f"version {version}: {len(payload)} bytes do not fit its digest board "
                         f"({board.numel() - _HEAD.size})")
    clear(board)  # (the old stamp first: a reader never pairs it with a half-written post)
    body = _HEAD.pack(0, state, count, version)[8:] + payload
    board[8 : 8 + len(body)].copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))
    stamp = struct.pack("<Q", _stamp(body, layout_digest))
    board[:8].copy_(torch.frombuffer(bytearray(stamp), dtype=torch.uint8))  # (last: it makes the post valid)


def _stamp(body: bytes, layout_digest: str) -> int:
    # (never 0: a cleared board has no valid post)
    return xxhash.xxh3_64_intdigest(body + layout_digest.encode()) or 1
