"""A receiver's side of the ``nixl`` transport: a version pulled from its owner, verified like a pushed one.

The owner's descriptor (read first, from the owner's memory, and checked against the offer's digest of it)
stands in for the frames of a push: the header starts the version, each bucket is READ
from the owner's region straight into where the staging puts it (two on the wire at once where they land in a
whole buffer), checked against the owner's digests as it lands, and the trailer ends it. Everything after that
(the version digest, the load, the result) is the assembler's, as for every transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import xxhash

from ckpt_engine.codec import decode
from ckpt_engine.errors import CkptEngineError, ProtocolError
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.receive.assembly import VersionAssembler
from ckpt_engine.receive.buffers import StagingBuffers
from ckpt_engine.receive.payload import ReceiveResult
from ckpt_engine.transport.messages import PullDescriptor, PullOffer, PullRegion, VersionTrailer
from ckpt_engine.transport.nixl import NixlEndpoint, Region


class NixlFeed:
    """The assembler's Feed over one owner's offer; every read bounded by the version's deadline."""

    parallel = 2

    def __init__(self, endpoint: NixlEndpoint, offer: PullOffer, described: PullDescriptor, layout: Layout,
                 deadline: float) -> None:
        version = described.header.version
        if len(described.digests) != len(layout.buckets):
            raise ProtocolError(f"version {version}: {len(described.digests)} buckets of digests for "
                                f"{len(layout.buckets)} buckets")
        if described.offset + layout.total_bytes > offer.region.nbytes:
            raise ProtocolError(f"version {version} of {layout.total_bytes} bytes does not fit the owner's region "
                                f"of {offer.region.nbytes} at {described.offset}")
        self.endpoint, self.described, self.deadline = endpoint, described, deadline
        self.remote = endpoint.remote(offer.agent)
        self.source = _region(offer.region)
        self.read_into: list[torch.Tensor] = []  # what the reads write into (retired if the pull fails)

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]] | None:
        self.endpoint.register(into)  # (the staging buffer's storage: registered once, reused by every version)
        self.read_into.append(into)
        read = self.endpoint.start_read(self.remote, self.source,
                                        [(self.described.offset + bucket.flat_offset, into[: bucket.nbytes])])
        digests = self.described.digests[bucket.index]

        def wait() -> list[int]:
            read.wait(max(0.0, self.deadline - time.monotonic()))
            return digests

        return wait

    def trailer(self) -> VersionTrailer:
        return self.described.trailer

    def follow_the_rest(self, layout: Layout) -> None:
        """Nothing to drain: a pull that stops reads nothing more."""


def describe(endpoint: NixlEndpoint, offer: PullOffer, deadline: float) -> PullDescriptor:
    """The offer's descriptor, read from the owner's memory; a ProtocolError if its bytes are not what the owner
    offered (digest) or not a descriptor of the offered version."""
    remote = endpoint.remote(offer.agent)
    scratch = torch.empty(offer.descriptor_nbytes, dtype=torch.uint8)
    endpoint.register(scratch)
    try:
        endpoint.start_read(remote, _region(offer.descriptor), [(0, scratch)]).wait(
            max(0.0, deadline - time.monotonic()))
    except CkptEngineError:
        endpoint.retire([scratch])  # (a late write may still land in it)
        raise
    raw = scratch.numpy().tobytes()
    endpoint.forget(scratch)
    if xxhash.xxh3_64_hexdigest(raw) != offer.descriptor_digest:
        raise ProtocolError(f"version {offer.version}: the owner's descriptor does not match its digest")
    described = decode(PullDescriptor, raw)
    if described.header.version != offer.version or described.trailer.version != offer.version:
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
        endpoint.drop_remote(offer.agent)
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
    except CkptEngineError as exc:
        endpoint.drop_remote(offer.agent)  # (an owner that failed a read is reached afresh next time)
        # A read given up on may still land: the staging it read into is retired (kept registered, so alive,
        # for two more failures) and the next version gets new staging.
        if feed is not None:
            endpoint.retire(feed.read_into)
        assembler.buffers = StagingBuffers(assembler.device)
        return assembler.finish(incoming, f"pulling version {offer.version}: {exc}")
    return assembler.conclude(incoming, feed.trailer())


def _region(wire: PullRegion) -> Region:
    return Region(wire.addr, wire.nbytes, wire.mem, wire.device_id)
