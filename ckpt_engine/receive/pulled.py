"""A receiver's side of the ``nixl`` transport: a version pulled from its owner, verified like a pushed one.

The owner's ``PullOffer`` stands in for the frames of a push: the header starts the version, each bucket is READ
from the owner's region straight into where the staging puts it (two on the wire at once where they land in a
whole buffer), checked against the owner's digests as it lands, and the trailer ends it. Everything after that
(the version digest, the load, the result) is the assembler's, as for every transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ckpt_engine.errors import CkptEngineError, ProtocolError
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.receive.assembly import VersionAssembler
from ckpt_engine.receive.buffers import StagingBuffers
from ckpt_engine.receive.payload import ReceiveResult
from ckpt_engine.transport.messages import PullOffer, VersionTrailer
from ckpt_engine.transport.nixl import NixlEndpoint, Region


class NixlFeed:
    """The assembler's Feed over one owner's offer; every read bounded by the version's deadline."""

    parallel = 2

    def __init__(self, endpoint: NixlEndpoint, offer: PullOffer, layout: Layout, deadline: float) -> None:
        if len(offer.digests) != len(layout.buckets):
            raise ProtocolError(f"version {offer.header.version}: {len(offer.digests)} buckets of digests for "
                                f"{len(layout.buckets)} buckets")
        if offer.offset + layout.total_bytes > offer.region.nbytes:
            raise ProtocolError(f"version {offer.header.version} of {layout.total_bytes} bytes does not fit the "
                                f"owner's region of {offer.region.nbytes} at {offer.offset}")
        self.endpoint, self.offer, self.deadline = endpoint, offer, deadline
        self.remote = endpoint.remote(offer.agent)
        self.source = Region(offer.region.addr, offer.region.nbytes, offer.region.mem, offer.region.device_id)

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]] | None:
        self.endpoint.register(into)  # (the staging buffer's storage: registered once, reused by every version)
        read = self.endpoint.start_read(self.remote, self.source,
                                        [(self.offer.offset + bucket.flat_offset, into[: bucket.nbytes])])
        digests = self.offer.digests[bucket.index]

        def wait() -> list[int]:
            read.wait(max(0.0, self.deadline - time.monotonic()))
            return digests

        return wait

    def trailer(self) -> VersionTrailer:
        return self.offer.trailer

    def follow_the_rest(self, layout: Layout) -> None:
        """Nothing to drain: a pull that stops reads nothing more."""


def pull(assembler: VersionAssembler, endpoint: NixlEndpoint, offer: PullOffer, timeout_s: float) -> ReceiveResult:
    """Pull ``offer``'s version into ``assembler`` (verified, then loaded); the result says why if it failed.
    A failed read (the owner died, stalled past ``timeout_s``, or withdrew its region) fails this version only:
    the model keeps what it held."""
    incoming = assembler.begin(offer.header)
    try:
        feed = NixlFeed(endpoint, offer, incoming.layout, time.monotonic() + timeout_s)
        for _ in assembler.flow(incoming, feed):
            pass
    except CkptEngineError as exc:
        endpoint.drop_remote(offer.agent)  # (an owner that failed a read is reached afresh next time)
        # A read given up on may still land. The staging it reads into is never used again: it stays registered
        # (the endpoint keeps it alive), so a late write goes where nothing reads; the next version gets new.
        assembler.buffers = StagingBuffers(assembler.device)
        return assembler.finish(incoming, f"pulling version {offer.header.version}: {exc}")
    return assembler.conclude(incoming, feed.trailer())
