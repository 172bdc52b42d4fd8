"""A receiver's side of the ``nixl`` transport: a version pulled from its owners, verified like a pushed one.

The lead owner's descriptor (read first, from its memory, and checked against the offer's digest of it)
stands in for the header of a push. Each bucket is READ from its owner's share straight into where the staging
puts it (two of each owner's on the wire at once where they land in a whole buffer) and checked against the
digests that owner posts on its board, read when its first bucket lands: a version is offered before its
digests are known, so the pulls overlap the owners' digest pass. Everything after that (the version digest,
the load, the result) is the assembler's, as for every transport.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import xxhash

from ckpt_engine.codec import decode
from ckpt_engine.errors import CkptEngineError, ProtocolError, SyncTimeoutError
from ckpt_engine.plan.hashing import version_digest
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.plan.owners import Owners, single_owner
from ckpt_engine.plan.pull_reads import KEPT, bucket_reads
from ckpt_engine.receive.assembly import VersionAssembler
from ckpt_engine.receive.buffers import StagingBuffers
from ckpt_engine.receive.payload import ReceiveResult
from ckpt_engine.retry import Backoff
from ckpt_engine.transport.digest_board import board_nbytes, read_post
from ckpt_engine.transport.messages import PullDescriptor, PullOffer, PullRegion, VersionHeader, VersionTrailer
from ckpt_engine.transport.nixl import READ_POLL_MAX_S, NixlEndpoint, PullFailed, Read, Region

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

_PLANS_KEPT = 2  # read plans kept: a puller pulls one class (a 70B class at TP 8: 1.3M reads, 42 MB)


class _Plans:
    """The read plans of the latest pulls, by what they are made of (thread-safe)."""

    def __init__(self, kept: int) -> None:
        self._kept, self._lock, self._plans = kept, threading.Lock(), OrderedDict[tuple, list[torch.Tensor]]()

    def get(self, key: tuple) -> list[torch.Tensor] | None:
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
            return self._plans.get(key)

    def put(self, key: tuple, reads: list[torch.Tensor]) -> None:
        with self._lock:
            self._plans[key] = reads
            while len(self._plans) > self._kept:
                self._plans.popitem(last=False)


_last_plans = _Plans(_PLANS_KEPT)

# How soon a puller reads the lead's board again while its digests are not posted yet (doubling up to the last).
_FIRST_RETRY_S = 0.001
_LAST_RETRY_S = 0.05
# A waiting puller reads the board of an owner whose post it needs this long after it last did so, the
# gap doubling up to _PACED_MAX_S: a 100k-piece board (800 KB) read every 2 ms cost 344 MiB/s of board bytes
_PACED_S = 0.004
_PACED_MAX_S = 0.064
_BOARD_READS = 2  # of one owner's board in flight at once (see PostedDigests)


class NixlFeed:
    """The assembler's Feed over an offer: each bucket read from its owner's share, every read bounded by the
    version's deadline. Two buckets of each owner may be on the wire at once. Each owner's digests are read from
    its board (they may still be being computed: see :class:`PostedDigests`), asked for behind each bucket's
    reads. A class's column pieces are read from what their owner kept (``kept_spans``) once it posted its
    digests: those of every bucket started then, at once."""

    def __init__(self, endpoint: NixlEndpoint, offer: PullOffer, described: PullDescriptor, layout: Layout,
                 deadline: float) -> None:
        self.owners = owners_of(described.header, layout, len(offer.sources))
        self.kept = kept_regions(offer, described)
        self.reads = reads_of(described, layout, self.owners, kept=self.kept is not None)
        self.endpoint, self.offer, self.described, self.deadline = endpoint, offer, described, deadline
        self.parallel = 2 * self.owners.ranks
        self.remotes = [endpoint.remote(source.agent) for source in offer.sources]
        self.digests = PostedDigests(endpoint, self.remotes, offer, described, layout, self.owners, deadline)
        self.read_into: list[torch.Tensor] = []  # what the reads write into (retired if the pull fails)
        self.pending_kept: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # bucket -> (owner, into, ranges)
        self.kept_reads: dict[int, Read] = {}  # by bucket

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]] | None:
        self.endpoint.register(into)  # (the staging buffer's storage: registered once, reused by every version)
        self.read_into.append(into)
        owner = self.owners.of[bucket.index]
        source = self.offer.sources[owner]
        spans = [(source.region, source.offset), *((span.region, span.offset) for span in source.more)]
        planned = self.reads[bucket.index].numpy()  # [buffer, offset in it, offset in the bucket, bytes] a row
        reads = []
        for buffer, ranges in _by_buffer(planned):
            if buffer == KEPT:
                self.pending_kept[bucket.index] = (owner, into, ranges)
                continue
            if not 0 <= buffer < len(spans):
                raise ProtocolError(f"version {self.described.header.version}: a read from owner rank {owner}'s "
                                    f"buffer {buffer}, of {len(spans)} offered")
            region, at = spans[buffer]
            reads.append(self.endpoint.start_read(self.remotes[owner], _region(region), into, ranges, at=at))
        self.digests.ask(owner, behind=True)  # (its reply comes behind these reads: its post likely known then)
        self._start_kept()

        def wait() -> list[int]:
            for read in reads:
                self._await(read)
            self._start_kept()
            digests = self.digests.of_bucket(bucket.index)
            self._start_kept()
            kept_read = self.kept_reads.pop(bucket.index, None)
            if kept_read is not None:
                kept_read.wait(max(0.0, self.deadline - time.monotonic()))
            return digests

        return wait

    def _await(self, read: Read) -> None:
        """Wait for ``read``, meanwhile reading the kept pieces of each owner whose post a board read brings:
        waiting on one owner's bytes must not leave another's link idle."""
        backoff = Backoff(initial_s=0.0002, max_s=READ_POLL_MAX_S)
        while self.pending_kept and not read.ended() and time.monotonic() < self.deadline:
            self._start_kept(ask=False)  # (besides those behind each bucket's reads, board reads are paced)
            for owner in {owner for owner, _, _ in self.pending_kept.values()}:
                self.digests.ask_paced(owner)
            backoff.wait()
        read.wait(max(0.0, self.deadline - time.monotonic()))

    def _start_kept(self, ask: bool = True) -> None:
        """Read the column pieces of every bucket started whose owner posted its digests (so kept them), as
        soon as any read of its board says so: whichever bucket is waited for. ``ask``: read the boards of
        those not known to have posted again (else only take the reads that ended)."""
        for owner in {owner for owner, _, _ in self.pending_kept.values()}:
            self.digests.ask(owner, again=ask)
        for index, (owner, into, ranges) in list(self.pending_kept.items()):
            if self.digests.computed[owner] is not None:
                del self.pending_kept[index]
                self.kept_reads[index] = self.endpoint.start_read(self.remotes[owner], self.kept[owner],  # type: ignore[index]
                                                                  into, ranges)

    def trailer(self) -> VersionTrailer:
        return self.digests.trailer()

    def follow_the_rest(self, layout: Layout) -> None:
        """Nothing to drain: a pull that stops reads nothing more."""


class PostedDigests:
    """The digests each owner posts on its board (transport/digest_board.py) of the pieces it holds: as
    computed (its buckets are checked against them, and what it kept is read), then as final (the version may
    be loaded). Every owner's board is read once before any bucket (ahead of the buckets on each owner's link:
    enough when the digests were posted first), then behind each bucket's reads until they are known (a read
    waits behind those before it on the owner's link), then, waiting for a post, again (backing off) until the
    version's deadline."""

    def __init__(self, endpoint: NixlEndpoint, remotes: list[str], offer: PullOffer, described: PullDescriptor,
                 layout: Layout, owners: Owners, deadline: float) -> None:
        self.endpoint, self.remotes, self.deadline = endpoint, remotes, deadline
        self.header, self.layout, self.owners = described.header, layout, owners
        self.regions = []
        for rank, source in enumerate(offer.sources):
            region = source.boards.get(described.board)
            if region is None:
                raise ProtocolError(f"version {described.header.version}: owner rank {rank} names no board for "
                                    f"{'class ' + described.board[:12] if described.board else 'the version'}")
            self.regions.append(_region(region))
        self.starts, held = [], [0] * owners.ranks  # (where each bucket's digests start on its owner's board)
        for bucket in layout.buckets:
            self.starts.append(held[owners.of[bucket.index]])
            held[owners.of[bucket.index]] += len(bucket.slots)
        self.held = held
        self.computed: list[list[int] | None] = [None] * owners.ranks
        self.posted: list[list[int] | None] = [None] * owners.ranks  # (final)
        # Each owner's board may be read twice at once: a read asked behind a bucket's reads is not held back
        # by one still in flight, whose reply waits behind other bytes on the link.
        self.scratch = [[torch.empty(board_nbytes(n), dtype=torch.uint8) for _ in range(_BOARD_READS)]
                        for n in held]
        for scratch in self._all_scratch():
            endpoint.register(scratch)
        self.reading: dict[int, list[tuple[Read, torch.Tensor]]] = {owner: [] for owner in range(owners.ranks)}
        self.paced = [(0.0, _PACED_S)] * owners.ranks  # (per owner: when it may be read again, the gap after)
        try:
            self._start_reads()
        except CkptEngineError:
            self.close(failed=True)
            raise

    def of_bucket(self, index: int) -> list[int]:
        """The digests of bucket ``index``'s pieces, once its owner posted them (computed, at least): its owner
        has kept its pieces by then."""
        posted, start = self._posted_by(self.owners.of[index], self.computed), self.starts[index]
        return posted[start : start + len(self.layout.buckets[index].slots)]

    def trailer(self) -> VersionTrailer:
        """What a push's trailer would say: the version digest of every piece's digest, in wire order, once
        every owner posted them as final. The lead's post is needed too, whatever it holds: it posts once the
        daemon has its report of the version (workers/trainer_agent.py), so nothing is loaded whose outcome
        the daemon cannot know."""
        for owner in range(self.owners.ranks):  # (every owner's board at once, not one after another)
            self._take(owner, block=False)
            self._start_read(owner)
        for owner in range(self.owners.ranks):
            self._posted_by(owner, self.posted)
        flat = [d for bucket in self.layout.buckets for d in self.of_bucket(bucket.index)]
        return VersionTrailer(version=self.header.version,
                              version_digest=version_digest(self.header.digest_algo, self.layout.digest, flat))

    def ask(self, owner: int, again: bool = True, behind: bool = False) -> None:
        """Take what an ended read of ``owner``'s board posts, without waiting; ``again``: read it again unless
        its computed digests are known or a read of it is in flight (``behind`` a bucket's reads just started:
        unless two are, one perhaps still on its way from before). So a bucket costs at most a read or two of
        its owner's board. (Asking until the final post is known too cost the 4-owner netns row ~10 % more
        puller CPU, and time: docs/performance-notes.md.)"""
        if self.posted[owner] is not None:
            return
        self._take(owner, block=False)
        if again and self.computed[owner] is None and len(self.reading[owner]) < (_BOARD_READS if behind else 1):
            self._start_read(owner)

    def ask_paced(self, owner: int) -> None:
        """Read ``owner``'s board again while its computed post is unknown and no read of it is in flight, at
        most every ``_PACED_S`` (doubling, per owner): a puller waiting on one owner's bytes learns another's
        post in time to read what it kept, and a big board is not read again and again."""
        if self.computed[owner] is not None or self.reading[owner]:
            return
        now = time.monotonic()
        if now < self.paced[owner][0]:
            return
        gap = self.paced[owner][1]
        self.paced[owner] = (now + gap, min(2 * gap, _PACED_MAX_S))
        self._start_read(owner)

    def _posted_by(self, owner: int, posts: list[list[int] | None]) -> list[int]:
        """What ``owner`` posted in ``posts`` (computed or final), read again (backing off) until it has, or
        the deadline."""
        delay = _FIRST_RETRY_S
        while (posted := posts[owner]) is None:
            if self.reading[owner]:  # (each read in flight first, the oldest first)
                self._take(owner, block=True)
                continue
            if time.monotonic() + delay > self.deadline:
                what = "final " if posts is self.posted and self.computed[owner] is not None else ""
                raise ProtocolError(f"version {self.header.version}: owner rank {owner} posted no {what}digests "
                                    "before the deadline")
            time.sleep(delay)
            delay = min(delay * 2, _LAST_RETRY_S)
            self._start_read(owner)
        return posted

    def close(self, failed: bool) -> None:
        """Done with the boards: a failed pull's scratch may still be written (a read given up on)."""
        if failed or any(self.reading.values()):
            self.endpoint.retire(self._all_scratch())
        else:
            for scratch in self._all_scratch():
                self.endpoint.forget(scratch)

    def _all_scratch(self) -> list[torch.Tensor]:
        return [scratch for each in self.scratch for scratch in each]

    def _start_reads(self) -> None:
        """Read every owner's board (all at once: behind a loaded link each read waits in its queue)."""
        for owner in range(self.owners.ranks):
            self._start_read(owner)

    def _start_read(self, owner: int) -> None:
        reading = self.reading[owner]
        if len(reading) < _BOARD_READS and self.posted[owner] is None:
            free = next(s for s in self.scratch[owner] if all(s is not used for _, used in reading))
            reading.append((self.endpoint.start_read(self.remotes[owner], self.regions[owner], free), free))

    def _take(self, owner: int, block: bool) -> None:
        """What ``owner``'s board read in flight posts, once it ended (``block``: waiting for it); a
        ProtocolError if the owner failed the version, or posted other digests than before."""
        reading = self.reading[owner]
        if not reading or not (block or reading[0][0].ended()):  # (the oldest first: posts only advance)
            return
        read, scratch = reading[0]
        try:
            read.wait(max(0.0, self.deadline - time.monotonic()))  # (still in flight if it timed out)
        except (PullFailed, SyncTimeoutError) as exc:
            raise type(exc)(f"reading owner rank {owner}'s digest board: {exc}") from exc
        del reading[0]
        post = read_post(scratch.numpy().tobytes(), self.header.version, self.layout.digest,
                         self.held[owner])
        if post is None:
            return
        digests, final = post
        if self.computed[owner] is not None and digests != self.computed[owner]:
            raise ProtocolError(f"version {self.header.version}: owner rank {owner} posted other digests than "
                                "those its pieces were checked against")
        self.computed[owner] = digests
        if final:
            self.posted[owner] = digests


def _by_buffer(planned: npt.NDArray[np.int64]) -> list[tuple[int, torch.Tensor]]:
    """A bucket's reads ([buffer, offset in it, offset in the bucket, bytes] rows) as each buffer's ranges
    (int64 [n, 3]): numpy, since a bucket has few rows and a torch op costs microseconds each."""
    import numpy as np  # (NIXL's own dependency: not imported with this module)

    buffers = planned[:, 0]
    first = int(buffers[0]) if len(buffers) else 0
    if (buffers == first).all():  # (most buckets: everything out of one buffer)
        return [(first, torch.from_numpy(np.ascontiguousarray(planned[:, 1:])))] if len(buffers) else []
    return [(int(buffer), torch.from_numpy(np.ascontiguousarray(planned[buffers == buffer, 1:])))
            for buffer in np.unique(buffers)]


def kept_regions(offer: PullOffer, described: PullDescriptor) -> list[Region] | None:
    """Where each owner keeps the column pieces of the class ``described`` (plan/pull_reads.py ``kept_spans``),
    or None where not every owner keeps them (then each is read a row at a time from the cached tensor)."""
    if not described.board or described.cut_from is None:
        return None
    regions = [source.kept.get(described.board) for source in offer.sources]
    return [_region(region) for region in regions if region is not None] if all(regions) else None


def reads_of(described: PullDescriptor, layout: Layout, owners: Owners, kept: bool = False) -> list[torch.Tensor]:
    """The reads that fill each bucket of ``layout`` (plan/pull_reads.py), from what the descriptor says the
    owners' buffers hold (``kept``: and the column pieces they keep), one int64 [n, 4] table a bucket (buffer,
    offset in it, offset in the bucket, bytes); a ProtocolError where they cannot. A class's layout and
    placement repeat from version to version, and without kept pieces a column piece is one read a row (1.3
    million for a 70B class at TP 8: seconds to plan), so the plans of the last versions are kept, by what they
    are made of; a delta's (its tensors placed anew each version) is not."""
    key = (layout.digest, owners, kept, xxhash.xxh3_128_hexdigest(
        described.model_dump_json(include={"cut_from", "cut_from_owners", "cut_at"}).encode()))
    planned = _last_plans.get(key)
    if planned is not None:
        return planned
    cut = described.cut_from
    try:
        whole = cut.to_layout() if cut is not None else None
        whole_owners = (Owners(owners.ranks, tuple(described.cut_from_owners))
                        if whole is not None and described.cut_from_owners is not None else None)
        reads = bucket_reads(layout, owners, whole, whole_owners, described.cut_at, kept=kept)
    except CkptEngineError as exc:
        raise ProtocolError(f"version {described.header.version}: its pieces cannot be read from its owners: "
                            f"{exc}") from exc
    try:
        planned = [torch.tensor(bucket, dtype=torch.int64).reshape(-1, 4) for bucket in reads]  # (32 B a read)
    except (OverflowError, RuntimeError, ValueError) as exc:  # (an offset past int64, from a hostile owner)
        raise ProtocolError(f"version {described.header.version}: its pieces cannot be read from its owners: "
                            f"an offset out of range ({exc})") from exc
    if described.cut_at is None:
        _last_plans.put(key, planned)
    return planned


def owners_of(header: VersionHeader, layout: Layout, sources: int) -> Owners:
    """The owner of every bucket, as the descriptor's header says, checked against the offer's sources."""
    owners = Owners(header.owner_ranks, tuple(header.owners)) if header.owners is not None else single_owner(layout)
    try:
        owners.check(layout)
    except CkptEngineError as exc:
        raise ProtocolError(f"version {header.version}: {exc}") from exc
    if owners.ranks != sources:
        raise ProtocolError(f"version {header.version} is owned by {owners.ranks} rank(s); the offer has "
                            f"{sources} source(s)")
    return owners


def describe(endpoint: NixlEndpoint, offer: PullOffer, deadline: float) -> PullDescriptor:
    """The offer's descriptor, read from the lead owner's memory; a ProtocolError if its bytes are not what the
    owner offered (digest) or not a descriptor of the offered version."""
    where = offer.descriptor
    if where is None:
        raise ProtocolError(f"the offer of version {offer.version} names no descriptor (one owner's part only)")
    remote = endpoint.remote(offer.sources[0].agent)
    scratch = torch.empty(where.nbytes, dtype=torch.uint8)
    endpoint.register(scratch)
    try:
        endpoint.start_read(remote, _region(where.region), scratch).wait(
            max(0.0, deadline - time.monotonic()))
    except CkptEngineError:
        endpoint.retire([scratch])  # (a late write may still land in it)
        raise
    raw = scratch.numpy().tobytes()
    endpoint.forget(scratch)
    if xxhash.xxh3_64_hexdigest(raw) != where.digest:
        raise ProtocolError(f"version {offer.version}: the owner's descriptor does not match its digest")
    described = decode(PullDescriptor, raw)
    if described.header.version != offer.version:
        raise ProtocolError(f"the offer of version {offer.version} describes version {described.header.version}")
    return described


def pull(assembler: VersionAssembler, endpoint: NixlEndpoint, offer: PullOffer, timeout_s: float,
         described: PullDescriptor | None = None) -> ReceiveResult:
    """Pull ``offer``'s version into ``assembler`` (verified, then loaded); the result says why if it failed.
    A failed read (the owner died, stalled past ``timeout_s``, or withdrew its region) fails this version only:
    the model keeps what it held. ``described``: the offer's descriptor, where the caller has read it already."""
    deadline = time.monotonic() + timeout_s
    try:
        described = described or describe(endpoint, offer, deadline)
    except CkptEngineError as exc:
        _drop_remotes(endpoint, offer)
        return ReceiveResult(offer.version, False, f"pulling version {offer.version}: {exc}")
    incoming = assembler.begin(described.header)
    if incoming.choice.mode == "stream":
        return assembler.finish(incoming, f"pulling version {offer.version}: staging chose stream "
                                f"({incoming.choice.why}), and a pulled version cannot be streamed into the load "
                                "yet: it needs device or host staging")
    feed = None
    try:
        feed = NixlFeed(endpoint, offer, described, incoming.layout, deadline)
        for _ in assembler.flow(incoming, feed):
            pass
        trailer = feed.trailer()
    except CkptEngineError as exc:
        _drop_remotes(endpoint, offer)  # (an owner that failed a read is reached afresh next time)
        # A read given up on may still land: the staging it read into is retired (kept registered, so alive,
        # until every read into it ended) and the next version gets new staging.
        if feed is not None:
            endpoint.retire(feed.read_into)
            feed.digests.close(failed=True)
        assembler.buffers = StagingBuffers(assembler.device)
        return assembler.finish(incoming, f"pulling version {offer.version}: {exc}")
    feed.digests.close(failed=False)
    endpoint.keep_remotes([source.agent for source in offer.sources])  # (owners of earlier jobs are gone)
    return assembler.conclude(incoming, trailer)


def _region(wire: PullRegion) -> Region:
    return Region(wire.addr, wire.nbytes, wire.mem, wire.device_id)


def _drop_remotes(endpoint: NixlEndpoint, offer: PullOffer) -> None:
    for source in offer.sources:
        endpoint.drop_remote(source.agent)
