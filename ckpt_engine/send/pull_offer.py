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
from ckpt_engine.transport.messages import (
    LayoutMessage,
    PullDescribed,
    PullDescriptor,
    PullOffer,
    PullRegion,
    PullSource,
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
    _refuse_delta(cached)
    region = endpoint.register(cached.buffer)
    return Offered(PullOffer(version=cached.version if version is None else version,
                             sources=[_source(endpoint, region, cached.buffer)]))


def offer_cached(endpoint: NixlEndpoint, cached: CachedVersion, *, version: int | None = None,
                 algo: DigestAlgo = "xxh3-64", descriptor_into: DescriptorInto | None = None,
                 digests: Sequence[int] = ()) -> Offered:
    """The lead owner's offer of ``cached`` (not a delta; with several owners, rank 0's share, the others
    offering theirs with ``offer_share``), labelled ``version`` (a re-push: the cached bytes of an older version
    under a new id; default: its own). ``descriptor_into(n)``: registered memory of at least n bytes for the
    descriptor (reused memory keeps the agent's metadata, which lists what is registered, the same from version
    to version; default: new memory, registered here). ``digests``: the per-piece digests of the whole version
    that its send just computed, in wire order (not computed again; required with several owners, whose bytes
    this rank does not hold); empty: computed here."""
    label = cached.version if version is None else version
    _refuse_delta(cached)
    region = endpoint.register(cached.buffer)
    layout, owners = cached.version_layout or cached.layout, cached.owners or single_owner(cached.layout)
    per_bucket = _by_bucket(layout, digests)
    if per_bucket is None and owners.ranks > 1:
        raise CacheError(f"version {cached.version} is owned by {owners.ranks} ranks: its offer needs the digests "
                         "its send gathered from every owner")
    if per_bucket is None:
        buffer = cached.buffer
        per_bucket = [bucket_digests(b, buffer[b.flat_offset : b.flat_offset + b.nbytes], algo,
                                     layout.digest).tolist() for b in layout.buckets]
    described, descriptor = _describe(endpoint, _header(label, layout, owners, algo, cached.step, cached.aliases),
                                      per_bucket, descriptor_into)
    # (the metadata is taken last: it lists what is registered, the descriptor included)
    return Offered(PullOffer(version=label, sources=[_source(endpoint, region, cached.buffer)],
                             descriptor=described), (descriptor,))


def offer_classes(endpoint: NixlEndpoint, cached: CachedVersion, classes: Mapping[str, PulledClass], *,
                  version: int | None = None, algo: DigestAlgo = "xxh3-64",
                  descriptor_into: DescriptorInto | None = None) -> Offered:
    """The lead owner's offer of a sharded version: a descriptor per pulled class (its layout of pieces, its
    digests as its send computed them, and the layout the pieces are cut from), the owners' shares as sources.
    A puller reads its class's pieces straight out of the shares: nothing is cut or copied here."""
    label = cached.version if version is None else version
    _refuse_delta(cached)
    region = endpoint.register(cached.buffer)
    whole, owners = cached.version_layout or cached.layout, cached.owners or single_owner(cached.layout)
    cut_from = LayoutMessage.of(whole)
    cut_from_owners = list(owners.of) if owners.ranks > 1 else None
    described, descriptors = {}, []
    for key, pulled in classes.items():
        plan = pulled.plan
        per_bucket = _by_bucket(plan.layout, pulled.digests)
        if per_bucket is None:
            raise CacheError(f"version {label}: class {key[:12]}'s send left {len(pulled.digests)} digests for "
                             f"{len(plan.layout.pieces)} pieces")
        header = _header(label, plan.layout, plan.owners or single_owner(plan.layout), algo, cached.step,
                         plan.aliases)
        described[key], descriptor = _describe(endpoint, header, per_bucket, descriptor_into, cut_from,
                                               cut_from_owners)
        descriptors.append(descriptor)
    return Offered(PullOffer(version=label, sources=[_source(endpoint, region, cached.buffer)], classes=described),
                   tuple(descriptors))


def _header(label: int, layout: Layout, owners: Owners, algo: DigestAlgo, step: int | None,
            aliases: Mapping[str, str]) -> VersionHeader:
    several = {"owner_ranks": owners.ranks, "owners": list(owners.of)} if owners.ranks > 1 else {}
    return VersionHeader(version=label, mode="cached", digest_algo=algo, layout_digest=layout.digest,
                         layout=LayoutMessage.of(layout), step=step, aliases=dict(aliases), created_at=time.time(),
                         **several)


def _describe(endpoint: NixlEndpoint, header: VersionHeader, per_bucket: list[list[int]],
              descriptor_into: DescriptorInto | None, cut_from: LayoutMessage | None = None,
              cut_from_owners: list[int] | None = None) -> tuple[PullDescribed, torch.Tensor]:
    """The descriptor of ``header``'s version (its digests, its trailer), encoded into registered memory."""
    trailer = VersionTrailer(version=header.version, version_digest=version_digest(
        header.digest_algo, header.layout_digest, [d for b in per_bucket for d in b]))
    raw = encode(PullDescriptor(header=header, digests=per_bucket, trailer=trailer, cut_from=cut_from,
                                cut_from_owners=cut_from_owners))
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
    if len(digests) != len(layout.pieces) or not digests:
        return None
    out, at = [], 0
    for bucket in layout.buckets:
        out.append(list(digests[at : at + len(bucket.slots)]))
        at += len(bucket.slots)
    return out


def _wire(region: Region) -> PullRegion:
    return PullRegion(addr=region.addr, nbytes=region.nbytes, mem=region.mem, device_id=region.device_id)


def _refuse_delta(cached: CachedVersion) -> None:
    if not cached.is_whole:
        raise CacheError(f"version {cached.version} is a delta of {cached.parent}: only whole cached versions are "
                         "offered for pulling so far")


def _source(endpoint: NixlEndpoint, region: Region, buffer: torch.Tensor) -> PullSource:
    return PullSource(agent=base64.b64encode(endpoint.metadata()),  # (its wire form)
                      region=_wire(region), offset=buffer.data_ptr() - region.addr)
