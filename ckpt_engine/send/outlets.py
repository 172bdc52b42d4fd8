"""Where a sender's buckets go. One version can go to several outlets at once: the collective sync group
(remote receivers) and the same-host IPC hub (colocated receivers). The sender drives every outlet through
the same steps, so both kinds of receiver get the same bytes and the same digests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ckpt_engine.codec import encode
from ckpt_engine.device import stream_synchronize
from ckpt_engine.errors import CkptEngineError, ProtocolError, ReceiversAbsent, SyncTimeoutError
from ckpt_engine.plan.layout import Bucket
from ckpt_engine.ranks import GroupRank, QuorumRank, plain_seat
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.messages import AbortMessage, Ack
from ckpt_engine.transport.same_host import IpcHub, IpcPeer, SharedSlot

log = logging.getLogger(__name__)


class Outlet(Protocol):
    def begin(self, version: int, layout_digest: str, full: Callable[[], bytes], slim: bytes, proto: int) -> None:
        """Announce a version. ``full()`` builds the header with the layout. ``slim`` carries only the layout's
        digest, for receivers known to hold that layout. ``proto``: what a receiver must speak to take it."""

    def reclaim(self, slot_index: int, k: int) -> None:
        """Return once send slot ``slot_index`` may be overwritten with bucket ``k``."""

    def bucket(self, k: int, bucket: Bucket, buf: torch.Tensor, digests: torch.Tensor, slot_index: int) -> None: ...

    def flush(self) -> None: ...

    def end(self, version: int, trailer: bytes) -> None: ...

    def abort(self, version: int, extra_len: int, reason: bytes) -> None: ...

    def acks(self, version: int, own: Ack, timeout_s: float) -> list[Ack]: ...

    def release(self) -> None:
        """Called when the version is over, whatever its outcome."""


@dataclass
class LayoutSent:
    """The layouts a sender's receivers were last sent. Receivers keep them, so the next versions of that layout
    carry only its digest: at 100k tensors the layout is megabytes of msgpack to encode and decode.
    ``group``: the layout the sync group's receivers hold. ``peers``: each colocated receiver's, by agent id,
    with the connection it was sent on; a receiver that connected again is a new process or object and holds
    none. It lives as long as the sender, i.e. its route, because a receiver that got versions another way
    (another route, another owner count) holds another layout. It is cleared after a failed version, so the
    next one sends the layout again."""

    group: str | None = None
    peers: dict[str, tuple[IpcPeer, str]] = field(default_factory=dict)

    def forget(self) -> None:
        self.group = None
        self.peers.clear()


# A receiver's rank in the sync group -> its rank in the version's quorum, which acknowledgements are reported in
Seats = Callable[[GroupRank], QuorumRank]


class CollectiveOutlet:
    """The sync group, sent framed broadcasts (transport/framing.py). Bucket data goes out asynchronously.
    Acknowledgements are reported in quorum ranks (``seats``)."""

    def __init__(self, channel: Channel, layout_sent: LayoutSent, seats: Seats = plain_seat) -> None:
        self.channel = channel
        self.seats = seats
        self._pending: list[Any] = [None, None]
        self._in_flight: list[torch.Tensor | None] = [None, None]  # keeps the sent buffer alive
        self._version = 0
        self._layout_sent = layout_sent

    def begin(self, version: int, layout_digest: str, full: Callable[[], bytes], slim: bytes, proto: int) -> None:
        self._version = version
        header = slim if self._layout_sent.group == layout_digest else full()
        self._layout_sent.group = None  # unknown until the header went out whole
        group = self.channel.group
        group.ring()  # its receivers wait for this, up to the version's limit (see SyncGroup.ring)
        self.channel.open = True
        try:
            self.channel.frame(Frame(FrameKind.BEGIN, version, len(header), proto=proto), 0, "version begin")
            self.channel.payload(header, len(header), "version header")
        except CkptEngineError as exc:
            if group.carried:
                raise
            # The group's first collective failed. A member's false address looks like this too: the store takes
            # its word.
            raise ReceiversAbsent(f"the version's sync group never carried a frame: {exc}") from exc
        self._layout_sent.group = layout_digest

    def reclaim(self, slot_index: int, k: int) -> None:
        if self._pending[slot_index] is not None:
            self.channel.wait(self._pending[slot_index], f"bucket {k - 2} data")
            self._pending[slot_index] = self._in_flight[slot_index] = None

    def bucket(self, k: int, bucket: Bucket, buf: torch.Tensor, digests: torch.Tensor, slot_index: int) -> None:
        frame = Frame(FrameKind.BUCKET, self._version, k, bucket.nbytes, len(bucket.slots))
        # On gloo this frame also waits behind the previous bucket's data.
        self.channel.frame(frame, len(bucket.slots), f"bucket {k} header", extra=digests)
        if bucket.nbytes:
            self._pending[slot_index] = self.channel.data(buf)
            self._in_flight[slot_index] = buf

    def flush(self) -> None:
        for slot_index, work in enumerate(self._pending):
            if work is not None:
                self.channel.wait(work, "last bucket data")
                self._pending[slot_index] = self._in_flight[slot_index] = None

    def end(self, version: int, trailer: bytes) -> None:
        self.channel.open = False
        self.channel.frame(Frame(FrameKind.END, version, len(trailer)), 0, "version end")
        self.channel.payload(trailer, len(trailer), "version trailer")

    def abort(self, version: int, extra_len: int, reason: bytes) -> None:
        if not self.channel.open:  # the first frame its receivers see of this version
            self.channel.group.ring()
        self.channel.open = False
        self.channel.frame(Frame(FrameKind.ABORT, version, len(reason)), extra_len, "abort")
        self.channel.payload(reason, len(reason), "abort reason")

    def acks(self, version: int, own: Ack, timeout_s: float) -> list[Ack]:
        members = [GroupRank(rank) for rank in range(self.channel.group.world_size) if rank != self.channel.src]
        try:
            gathered = self.channel.exchange_acks(own, timeout_s)
        except CkptEngineError as exc:  # one collective for all cannot tell who did not answer
            return [Ack(version=version, rank=self.seats(rank), ok=False, reason=f"no acknowledgement from rank "
                        f"{self.seats(rank)}: the exchange of all ranks' acknowledgements failed ({exc})")
                    for rank in members]
        out = []
        for rank in members:
            ack = gathered[rank]
            if isinstance(ack, ProtocolError):
                ack = Ack(version=version, rank=rank, ok=False, reason=f"unreadable acknowledgement: {ack}")
            out.append(ack.model_copy(update={"rank": self.seats(rank)}))
        return out

    def release(self) -> None:
        pass


class IpcOutlet:
    """Colocated receivers. Each bucket is placed in a shared slot and announced with its metadata. A slot is
    reused only after every live receiver released what it held. A receiver that fails or falls silent is
    dropped and reported, and the others go on."""

    def __init__(self, hub: IpcHub, peers: list[IpcPeer], missing: dict[str, tuple[QuorumRank, str]],
                 timeout_s: float, layout_sent: LayoutSent, *, in_place: SharedSlot | None = None,
                 slots_key: str = "") -> None:
        """``in_place``: a shareable buffer (the cache) that already holds the version in wire layout.
        Receivers map it once and read every bucket where it is, so nothing is copied on either side.
        ``slots_key``: which of the hub's slots this stream uses; each class of a sharded version has its own."""
        self.hub, self.peers, self.timeout_s = hub, peers, timeout_s
        self.missing = missing  # agent id -> (its quorum rank, why it is not part of this version)
        self.in_place = in_place
        self.slots_key = slots_key
        self._layout_sent = layout_sent

    def begin(self, version: int, layout_digest: str, full: Callable[[], bytes], slim: bytes, proto: int) -> None:
        for peer in self._live():
            if peer.proto < proto:  # an older receiver is told why and left out of this version
                self._guard(peer, lambda p: self._refuse(p, version, proto))
                continue
            held = self._layout_sent.peers
            was = held.pop(peer.agent_id, None)  # unknown until the header went out whole
            header = slim if was is not None and was[0] is peer and was[1] == layout_digest else full()
            self._guard(peer, lambda p, header=header: self._map_and_begin(p, header))
            if peer.dropped is None:
                held[peer.agent_id] = (peer, layout_digest)

    def reclaim(self, slot_index: int, k: int) -> None:
        if self.in_place is not None:
            return  # each bucket has its own place in the buffer, so nothing is overwritten within a version
        # One deadline for all peers, at half the receivers' own wait for the next bucket. A peer that stopped
        # releasing is then dropped while the healthy ones still wait for us, instead of all of them failing.
        deadline = time.monotonic() + self.timeout_s / 2
        for peer in self._live():
            self._guard(peer, lambda p: self._wait_released(p, k - 2, deadline))

    def bucket(self, k: int, bucket: Bucket, buf: torch.Tensor, digests: torch.Tensor, slot_index: int) -> None:
        if self.in_place is None:
            target = self.hub.slot_set(self.slots_key).slots[slot_index].tensor
            if bucket.nbytes and buf.data_ptr() != target.data_ptr():
                target[: bucket.nbytes].copy_(buf)
                stream_synchronize(self.hub.device)  # receivers read the slot as soon as they are told
        message = {"type": "bucket", "seq": k, "slot": slot_index, "index": k, "nbytes": bucket.nbytes,
                   "digests": digests.tolist(), "names": [s.name for s in bucket.slots],
                   "in_place": self.in_place is not None}
        for peer in self._live():
            self._guard(peer, lambda p: p.channel.send(message))

    def flush(self) -> None:
        pass

    def end(self, version: int, trailer: bytes) -> None:
        for peer in self._live():
            self._guard(peer, lambda p: p.channel.send({"type": "end", "trailer": trailer}))

    def abort(self, version: int, extra_len: int, reason: bytes) -> None:
        for peer in self._live():
            self._guard(peer, lambda p: p.channel.send({"type": "abort", "reason": reason}))

    def acks(self, version: int, own: Ack, timeout_s: float) -> list[Ack]:
        out = []
        deadline = time.monotonic() + timeout_s  # shared: silent peers do not add up their timeouts
        for peer in self.peers:
            if peer.dropped is None:
                self._guard(peer, lambda p: self._wait_ack(p, deadline))
            if peer.dropped is not None:
                out.append(Ack(version=version, rank=peer.rank, ok=False, reason=peer.dropped))
            else:
                out.append(Ack.model_validate(peer.pending_ack))
        out += [Ack(version=version, rank=rank, ok=False, reason=why) for rank, why in self.missing.values()]
        return out

    def absent(self) -> list[QuorumRank]:
        """The colocated receivers that never connected to the hub for this version; they are benched."""
        return [rank for rank, _ in self.missing.values()]

    def release(self) -> None:
        self.hub.release(self.peers)

    # ---- per peer ------------------------------------------------------------------------------------
    def _live(self) -> list[IpcPeer]:
        return [p for p in self.peers if p.dropped is None]

    def _guard(self, peer: IpcPeer, step) -> None:
        """Run one step with a peer; any failure drops that peer only."""
        try:
            step(peer)
        except (CkptEngineError, OSError) as exc:
            peer.dropped = f"colocated receiver {peer.agent_id} dropped: {exc}"
            log.warning("%s", peer.dropped)
            self.hub.forget(peer)

    def _map_and_begin(self, peer: IpcPeer, header: bytes) -> None:
        peer.released, peer.pending_ack = -1, None
        buffer = self.in_place
        if buffer is not None and buffer.index not in peer.mapped_buffers:
            peer.channel.send({"type": "map_buffer", "buffer": buffer.describe()}, [buffer.fd] if buffer.fd else None)
            self._expect(peer, "mapped")
            peer.mapped_buffers.add(buffer.index)
        slot_set = self.hub.slot_set(self.slots_key) if buffer is None else None
        if slot_set is not None and peer.mapped_generation != slot_set.generation:
            slots = slot_set.slots
            peer.channel.send({"type": "map", "generation": slot_set.generation,
                               "slots": [s.describe() for s in slots]}, [s.fd for s in slots if s.fd is not None])
            self._expect(peer, "mapped")
            peer.mapped_generation = slot_set.generation
        peer.channel.send({"type": "begin", "header": header, "buffer": buffer.index if buffer else None})

    def _refuse(self, peer: IpcPeer, version: int, proto: int) -> None:
        reason = (f"version {version} has tensors larger than a bucket, sent in pieces (same-host protocol "
                  f"{proto}); this receiver speaks protocol {peer.proto}: upgrade ckpt-engine where it runs")
        peer.channel.send({"type": "abort", "reason": encode(AbortMessage(version=version, reason=reason))})
        raise ProtocolError(reason)

    def _wait_released(self, peer: IpcPeer, seq: int, deadline: float) -> None:
        while peer.released < seq:
            self._expect(peer, "release", _left(deadline))

    def _wait_ack(self, peer: IpcPeer, deadline: float) -> None:
        while peer.pending_ack is None:
            self._expect(peer, "ack", _left(deadline))

    def _expect(self, peer: IpcPeer, kind: str, timeout_s: float | None = None) -> None:
        """Read one frame from the peer. Releases and acks update its state; anything else but the expected
        "mapped" is an error."""
        try:
            message, _ = peer.channel.recv(self.timeout_s if timeout_s is None else timeout_s)
        except SyncTimeoutError:
            limit = self.timeout_s if timeout_s is None else timeout_s
            raise SyncTimeoutError(f"no '{kind}' within {limit:.1f}s") from None
        kind_seen = message["type"]
        if kind_seen == "release":
            peer.released = max(peer.released, int(message.get("seq", -1)))
        elif kind_seen == "ack":
            peer.pending_ack = message.get("ack")
        elif kind_seen == "mapped" and kind == "mapped":
            return
        else:
            raise ProtocolError(f"expected '{kind}', got '{kind_seen}'")


def _left(deadline: float) -> float:
    """Time left until ``deadline``. The floor lets what a peer already sent still be read."""
    return max(deadline - time.monotonic(), 0.05)
