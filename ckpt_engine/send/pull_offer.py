"""An owner's side of the ``nixl`` transport: a cached version offered for receivers to pull.

The version's buffer (with several owner ranks, each rank's share) is registered with this process's NIXL
agent once (pool buffers are reused, so later versions find it registered). What a push would put in its
frames (header, every bucket's digests, trailer) is encoded once by the lead owner into a small registered
buffer of its own, the descriptor, which pullers read like the buckets: the offer that goes through the
control plane stays small whatever the model. The caller keeps the version leased (``VersionCache.lease``)
and the descriptor registered for as long as a pull may read them.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from ckpt_engine.codec import encode
from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import CacheError
from ckpt_engine.plan.hashing import bucket_digests, version_digest
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners, single_owner
from ckpt_engine.send.cache import CachedVersion
from ckpt_engine.send.class_senders import PulledClass
from ckpt_engine.send.transfer import WirePlan
from ckpt_engine.transport.messages import (
    LayoutMessage,
    PullDescribed,
    PullDescriptor,
    PullOffer,
    PullRegion,
    PullSource,
    PullSpan,
    VersionHeader,
    VersionTrailer,
)
from ckpt_engine.transport.nixl import NixlEndpoint, Region


@dataclass(frozen=True)
class Offered:
    offer: PullOffer
    # registered with the endpoint: ``endpoint.forget`` each once no pull may read it
    descriptors: tuple[torch.Tensor, ...] = ()


DescriptorInto = Callable[[int], torch.Tensor]


def offer_share(endpoint: NixlEndpoint, cached: CachedVersion, *, version: int | None = None) -> Offered:
    """The share ``cached`` holds of its version (all of it, with one owner), registered and offered without a
    descriptor: what an owner rank other than the lead serves of a version several ranks own."""
    return Offered(PullOffer(version=cached.version if version is None else version,
                             sources=[_source(endpoint, cached)]))


def offer_cached(endpoint: NixlEndpoint, cached: CachedVersion, *, version: int | None = None,
                 algo: DigestAlgo = "xxh3-64", descriptor_into: DescriptorInto | None = None,
                 digests: Sequence[int] = (), plan: WirePlan | None = None) -> Offered:
    """The lead owner's offer of ``cached`` (with several owners, rank 0's share, the others offering theirs
    with ``offer_share``), labelled ``version`` (a re-push: the cached bytes of an older version under a new id;
    default: its own). ``plan`` and ``digests``: what its send just put on the wire (e.g. a sparse version's
    changes) and every piece's digest, in wire order (not computed again; required with several owners, whose
    bytes this rank does not hold, and for anything but the whole version). ``descriptor_into(n)``: registered
    memory of at least n bytes for the descriptor (reused memory keeps the agent's metadata, which lists what is
    registered, the same from version to version; default: new memory, registered here)."""
    label = cached.version if version is None else version
    whole, owners = _whole_of(cached)
    plan = plan or WirePlan(whole, owners, dict(cached.aliases), cached.step, {})
    per_bucket = _by_bucket(plan.layout, digests)
    if per_bucket is None:
        if owners.ranks > 1 or plan.layout.digest != whole.digest or not cached.is_whole:
            raise CacheError(f"version {label}: its offer needs the digests its send computed of every piece")
        buffer = cached.buffer
        per_bucket = [bucket_digests(b, buffer[b.flat_offset : b.flat_offset + b.nbytes], algo,
                                     whole.digest).tolist() for b in whole.buckets]
    described, descriptor = _describe(endpoint, _header(label, plan, algo), per_bucket, descriptor_into,
                                      _placement(cached, plan.layout))
    # (the source last: its metadata lists what is registered, the descriptor included)
    return Offered(PullOffer(version=label, sources=[_source(endpoint, cached)], descriptor=described), (descriptor,))


def offer_classes(endpoint: NixlEndpoint, cached: CachedVersion, classes: Mapping[str, PulledClass], *,
                  version: int | None = None, algo: DigestAlgo = "xxh3-64",
                  descriptor_into: DescriptorInto | None = None) -> Offered:
    """The lead owner's offer of a sharded version: a descriptor per pulled class (its pieces as its send put
    them on the wire, their digests, and where the full tensors they are cut from lie), the owners' shares as
    sources. A puller reads its class's pieces straight out of the shares: nothing is cut or copied here."""
    label = cached.version if version is None else version
    described, descriptors = {}, []
    cut = _cut_placement(cached)  # (the same for every class: encoded once, not once a class)
    for key, pulled in classes.items():
        per_bucket = _by_bucket(pulled.plan.layout, pulled.digests)
        if per_bucket is None:
            raise CacheError(f"version {label}: class {key[:12]}'s send left {len(pulled.digests)} digests for "
                             f"{len(pulled.plan.layout.pieces)} pieces")
        described[key], descriptor = _describe(endpoint, _header(label, pulled.plan, algo), per_bucket,
                                               descriptor_into, _placement(cached, pulled.plan.layout, cut))
        descriptors.append(descriptor)
    return Offered(PullOffer(version=label, sources=[_source(endpoint, cached)], classes=described),
                   tuple(descriptors))


@dataclass(frozen=True)
class _Placement:
    """Where the tensors a wire layout is cut from lie in the owners' buffers (see ``PullDescriptor``)."""

    cut_from: LayoutMessage
    cut_from_owners: list[int] | None
    cut_at: list[list[int]] | None


def _placement(cached: CachedVersion, wire: Layout, cut: _Placement | None = None) -> _Placement | None:
    """None when the pullers read ``wire``'s buckets as they lie in the shares (the whole version, cached
    whole); else where the full tensors lie (``cut``, where the caller has it), for the pullers to cut
    ``wire``'s pieces from."""
    whole, _ = _whole_of(cached)
    if cached.is_whole and wire.digest == whole.digest:
        return None
    return cut or _cut_placement(cached)


def _cut_placement(cached: CachedVersion) -> _Placement:
    """Where every full tensor of ``cached`` lies in its owners' buffers."""
    whole, owners = _whole_of(cached)
    several = list(owners.of) if owners.ranks > 1 else None
    if cached.is_whole:
        return _Placement(LayoutMessage.of(whole), several, None)
    if owners.ranks > 1:
        raise CacheError(f"version {cached.version} is a delta of {cached.parent} owned by {owners.ranks} ranks: "
                         "pullers read a delta of one owner only")
    spans = [(buffer.data_ptr(), buffer.numel() * buffer.element_size()) for buffer in cached.buffers]
    views, at = cached.views(), []
    for slot in whole.slots:
        if not slot.nbytes:  # (an empty tensor lies nowhere: nothing of it is read)
            at.append([0, 0])
            continue
        ptr = views[slot.name].data_ptr()
        index = next((i for i, (start, size) in enumerate(spans) if start <= ptr and ptr + slot.nbytes <= start + size),
                     None)
        if index is None:
            raise CacheError(f"version {cached.version}: tensor {slot.name} lies outside its cached buffers")
        at.append([index, ptr - spans[index][0]])
    return _Placement(LayoutMessage.of(whole), None, at)


def _whole_of(cached: CachedVersion) -> tuple[Layout, Owners]:
    return cached.version_layout or cached.layout, cached.owners or single_owner(cached.layout)


def _header(label: int, plan: WirePlan, algo: DigestAlgo) -> VersionHeader:
    owners = plan.owners
    several = {"owner_ranks": owners.ranks, "owners": list(owners.of)} if owners.ranks > 1 else {}
    return VersionHeader(version=label, mode="cached", digest_algo=algo, layout_digest=plan.layout.digest,
                         layout=LayoutMessage.of(plan.layout), step=plan.step, aliases=dict(plan.aliases),
                         created_at=time.time(), **{**plan.extra, **several})


def _describe(endpoint: NixlEndpoint, header: VersionHeader, per_bucket: list[list[int]],
              descriptor_into: DescriptorInto | None, placement: _Placement | None
              ) -> tuple[PullDescribed, torch.Tensor]:
    """The descriptor of ``header``'s version (its digests, its trailer), encoded into registered memory."""
    trailer = VersionTrailer(version=header.version, version_digest=version_digest(
        header.digest_algo, header.layout_digest, [d for b in per_bucket for d in b]))
    cut = {} if placement is None else {"cut_from": placement.cut_from, "cut_from_owners": placement.cut_from_owners,
                                        "cut_at": placement.cut_at}
    raw = encode(PullDescriptor(header=header, digests=per_bucket, trailer=trailer, **cut))
    if descriptor_into is None:
        descriptor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    else:
        descriptor = descriptor_into(len(raw))
        descriptor[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    where = endpoint.register(descriptor)
    if descriptor.data_ptr() != where.addr:
        raise CacheError("a descriptor must start its registered memory")  # (the offer says: at the region's start)
    return PullDescribed(region=_wire(where), nbytes=len(raw), digest=xxhash.xxh3_64_hexdigest(raw)), descriptor


def _by_bucket(layout: Layout, digests: Sequence[int]) -> list[list[int]] | None:
    """``digests`` (one per piece, in wire order) bucket by bucket; None when they are not one per piece. (A
    sparse version where nothing changed has no piece: no digest, no bucket.)"""
    if len(digests) != len(layout.pieces):
        return None
    out, at = [], 0
    for bucket in layout.buckets:
        out.append(list(digests[at : at + len(bucket.slots)]))
        at += len(bucket.slots)
    return out


def _wire(region: Region) -> PullRegion:
    return PullRegion(addr=region.addr, nbytes=region.nbytes, mem=region.mem, device_id=region.device_id)


def _source(endpoint: NixlEndpoint, cached: CachedVersion) -> PullSource:
    """Every buffer ``cached`` reads, registered (pool buffers are reused: most are registered already)."""
    spans = []
    for buffer in cached.buffers:
        region = endpoint.register(buffer)
        spans.append(PullSpan(region=_wire(region), offset=buffer.data_ptr() - region.addr))
    return PullSource(agent=base64.b64encode(endpoint.metadata()),  # (its wire form)
                      region=spans[0].region, offset=spans[0].offset, more=spans[1:])
