"""The digest board (transport/digest_board.py) and the meeting of a send's digests with an offer's boards
(send/own_digests.py): pure rules, table-tested."""

from __future__ import annotations

import struct

import pytest
import torch

from ckpt_engine.errors import CacheError, ProtocolError
from ckpt_engine.send.own_digests import OwnDigests
from ckpt_engine.transport.digest_board import (
    REASON_BYTES,
    board_nbytes,
    clear,
    post_digests,
    post_failure,
    read_board,
    read_post,
)

LAYOUT = "ab" * 8
DIGESTS = [0, 1, -1, 2**63 - 1, -(2**63), 123456789]


def _board(pieces: int = len(DIGESTS)) -> torch.Tensor:
    board = torch.full((board_nbytes(pieces),), 0xAB, dtype=torch.uint8)  # (garbage: a reused slot)
    clear(board)
    return board


def _raw(board: torch.Tensor) -> bytes:
    return board.numpy().tobytes()


def test_posted_digests_read_back_exactly_for_their_version_and_layout_only() -> None:
    board = _board()
    assert read_board(_raw(board), 5, LAYOUT, len(DIGESTS)) is None  # nothing posted yet
    post_digests(board, 5, LAYOUT, DIGESTS)
    assert read_board(_raw(board), 5, LAYOUT, len(DIGESTS)) == DIGESTS
    assert read_board(_raw(board), 6, LAYOUT, len(DIGESTS)) is None  # another version's post: not yet
    assert read_board(_raw(board), 5, "cd" * 8, len(DIGESTS)) is None  # another layout's
    with pytest.raises(ProtocolError, match="6 digests for 5 pieces"):
        read_board(_raw(board), 5, LAYOUT, 5)


@pytest.mark.parametrize("damage", ["stamp", "payload", "short", "cleared", "unstamped"])
def test_a_torn_or_damaged_post_reads_as_not_posted(damage: str) -> None:
    board = _board()
    post_digests(board, 5, LAYOUT, DIGESTS)
    raw = bytearray(_raw(board))
    if damage == "stamp":
        raw[0] ^= 1
    elif damage == "payload":
        raw[24 + 3] ^= 1  # (a digest half-written when it was read)
    elif damage == "cleared":
        raw[:24] = bytes(24)  # (read while the next post was being written: cleared first)
    elif damage == "unstamped":  # (its header half-written: no stamp yet, whatever its count says)
        raw[:8] = bytes(8)
        raw[12:16] = struct.pack("<I", 1 << 30)
    else:
        raw = raw[:20]
    assert read_board(bytes(raw), 5, LAYOUT, len(DIGESTS)) is None


def test_a_post_of_this_version_bigger_than_its_board_is_refused_not_waited_on() -> None:
    """(Found by the outside attack on the early offer: a count beyond the board read as "not yet", and the
    puller waited out its deadline on a hostile owner.)"""
    board = _board()
    post_digests(board, 5, LAYOUT, DIGESTS)
    raw = bytearray(_raw(board))
    raw[12:16] = struct.pack("<I", 1 << 30)
    with pytest.raises(ProtocolError, match="claims 1073741824 digests, more than it holds"):
        read_board(bytes(raw), 5, LAYOUT, len(DIGESTS))
    assert read_board(bytes(raw), 4, LAYOUT, len(DIGESTS)) is None  # (another version's: not ours to judge)


def test_a_failure_is_read_as_an_error_with_its_reason_cut_to_size() -> None:
    board = _board()
    post_digests(board, 5, LAYOUT, DIGESTS)
    post_failure(board, 5, LAYOUT, "the owners disagreed" + "x" * 5000)
    with pytest.raises(ProtocolError, match="gave up on it: the owners disagreed") as caught:
        read_board(_raw(board), 5, LAYOUT, len(DIGESTS))
    assert len(str(caught.value)) < REASON_BYTES + 200


def test_a_post_that_does_not_fit_or_is_not_int64_is_refused() -> None:
    with pytest.raises(CacheError, match="do not fit"):
        post_digests(torch.zeros(30, dtype=torch.uint8), 1, LAYOUT, DIGESTS)
    with pytest.raises(CacheError, match="not an int64"):
        post_digests(_board(), 1, LAYOUT, [2**64])
    assert read_board(_raw(_board(0)), 1, LAYOUT, 0) is None
    empty = _board(0)
    post_digests(empty, 1, LAYOUT, [])  # (a version with nothing of this owner's: zero digests, posted)
    assert read_board(_raw(empty), 1, LAYOUT, 0) == []


class _Sink:
    """What an offer's board gets: its final posts in ``got``, every post in ``all``."""

    def __init__(self) -> None:
        self.got: list[tuple[list[int], str]] = []
        self.all: list[tuple[list[int], str, bool]] = []

    def post(self, digests, layout_digest: str, final: bool = True) -> None:
        self.all.append((list(digests), layout_digest, final))
        if final:
            self.got.append((list(digests), layout_digest))


def test_a_rank_posts_its_digests_as_computed_before_the_vote_and_final_after_it() -> None:
    """Computed as soon as this rank's buckets are digested and kept (its pullers check and read what it
    kept), final once the owners voted: for an offer made between or after the two; a lead's final
    post is held back until released (its pullers see the computed one meanwhile)."""
    own = OwnDigests()
    own.expect(1)
    own.expect(2, hold=True)
    before, between, after, held = _Sink(), _Sink(), _Sink(), _Sink()
    own.wanted(1, "", before)
    own.computed(1, "", LAYOUT, [1, 2], final=False)
    own.wanted(1, "", between)
    assert before.all == between.all == [([1, 2], LAYOUT, False)] and not own.known(1, "")
    own.computed(1, "", LAYOUT, [1, 2])
    own.wanted(1, "", after)
    assert before.all == [([1, 2], LAYOUT, False)]  # (a re-offer of the version replaced it)
    assert between.all == [([1, 2], LAYOUT, False), ([1, 2], LAYOUT, True)]
    assert after.all == [([1, 2], LAYOUT, True)] and own.known(1, "")
    own.computed(1, "", LAYOUT, [1, 2], final=False)  # (late: nothing more is posted, the final one stays)
    assert after.all == [([1, 2], LAYOUT, True)]
    own.wanted(2, "", held)
    own.computed(2, "", LAYOUT, [5], final=False)
    own.computed(2, "", LAYOUT, [5])
    assert held.got == [] and all(not final for *_, final in held.all) and own.known(2, "")
    own.release(2)
    assert held.got == [([5], LAYOUT)]


@pytest.mark.parametrize("final", [True, False])
def test_a_post_reads_back_as_computed_or_final(final: bool) -> None:
    board = torch.zeros(board_nbytes(2), dtype=torch.uint8)
    post_digests(board, 4, LAYOUT, [7, -8], final=final)
    raw = board.numpy().tobytes()
    assert read_post(raw, 4, LAYOUT, 2) == ([7, -8], final)
    assert read_board(raw, 4, LAYOUT, 2) == ([7, -8] if final else None)


def test_a_sends_digests_meet_an_offer_made_before_or_after_it() -> None:
    own = OwnDigests()
    own.expect(1)
    early = _Sink()
    own.wanted(1, "", early)  # offered before the send
    assert early.got == []
    own.computed(1, "", LAYOUT, [1, 2])
    own.computed(1, "class-a", LAYOUT, [3])  # (another key: not this sink's)
    assert early.got == [([1, 2], LAYOUT)]
    late = _Sink()
    own.wanted(1, "class-a", late)  # offered after the send
    assert late.got == [([3], LAYOUT)]
    again = _Sink()
    own.wanted(1, "", again)  # a re-offer of the same version finds them too
    assert again.got == [([1, 2], LAYOUT)]


def test_a_forgotten_offer_gets_nothing_and_only_the_latest_pulled_versions_are_kept() -> None:
    own = OwnDigests()
    own.expect(3)
    sink = _Sink()
    own.wanted(3, "", sink)
    own.forget(3)
    own.computed(3, "", LAYOUT, [1])
    assert sink.got == []  # (its memory may be reused by now)
    own.computed(4, "", LAYOUT, [4])  # nobody pulls 4: not kept
    for version in range(5, 20):
        own.expect(version)
        own.computed(version, "", LAYOUT, [version])
    oldest, unpulled, newest = _Sink(), _Sink(), _Sink()
    own.wanted(3, "", oldest)
    own.wanted(4, "", unpulled)
    own.wanted(19, "", newest)
    assert oldest.got == unpulled.got == [] and newest.got == [([19], LAYOUT)]


@pytest.mark.parametrize(("fields", "rank", "early"), [
    ({}, 0, True),  # a new cached version: offered as soon as it is cached
    ({"owners": 2}, 1, True),  # every owner rank offers its share then
    ({"owners": 2}, 2, False),  # a rank that owns nothing offers nothing
    ({"pullers": 0}, 0, False),  # nobody pulls it
    ({"mode": "bypass_cpu"}, 0, False),  # read from the send slots as its send fills them
    ({"sparse_base": 3}, 0, False),  # its changes are known once its send found them
    ({"sparse": True}, 0, False),
    ({"source_version": 3}, 0, False),  # a re-push checks its cached bytes first
])
def test_which_versions_are_offered_before_their_send(fields: dict, rank: int, early: bool) -> None:
    from ckpt_engine.control.messages import Assignment
    from ckpt_engine.workers.pull_server import offers_before_send

    assignment = Assignment(kind="send", version=4, **{"pullers": 2, **fields})
    assert offers_before_send(assignment, rank) is early
