"""An owner's side of the ``nixl`` transport: a cached version offered for receivers to pull.

The version's buffer is registered with this process's NIXL agent once (pool buffers are reused, so later
versions find it registered) and described in a ``PullOffer``: the agent, the region, and what a push would have
put in its frames (header, every bucket's digests, trailer). The caller keeps the version leased
(``VersionCache.lease``) for as long as a pull may read it.
"""

from __future__ import annotations

import base64
import time

from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import CacheError
from ckpt_engine.plan.hashing import bucket_digests, version_digest
from ckpt_engine.send.cache import CachedVersion
from ckpt_engine.transport.messages import LayoutMessage, PullOffer, PullRegion, VersionHeader, VersionTrailer
from ckpt_engine.transport.nixl import NixlEndpoint


def offer_cached(endpoint: NixlEndpoint, cached: CachedVersion, *, version: int | None = None,
                 algo: DigestAlgo = "xxh3-64") -> PullOffer:
    """``cached`` (a whole version: not a delta, not one rank's share) as a pull offer, labelled ``version``
    (a re-push: the cached bytes of an older version under a new id; default: its own)."""
    label = cached.version if version is None else version
    share = cached.version_layout is not None and cached.version_layout.digest != cached.layout.digest
    if not cached.is_whole or share:
        raise CacheError(f"version {cached.version} is a delta or one rank's share: only whole cached versions "
                         "are offered for pulling so far")
    layout, buffer = cached.layout, cached.buffer
    region = endpoint.register(buffer)
    digests = [bucket_digests(b, buffer[b.flat_offset : b.flat_offset + b.nbytes], algo, layout.digest).tolist()
               for b in layout.buckets]
    header = VersionHeader(version=label, mode="cached", digest_algo=algo, layout_digest=layout.digest,
                           layout=LayoutMessage.of(layout), step=cached.step, aliases=dict(cached.aliases),
                           created_at=time.time())
    trailer = VersionTrailer(version=label,
                             version_digest=version_digest(algo, layout.digest, [d for b in digests for d in b]))
    return PullOffer(agent=base64.b64encode(endpoint.metadata()),  # (Base64Bytes takes its wire form)
                     region=PullRegion(addr=region.addr, nbytes=region.nbytes, mem=region.mem,
                                       device_id=region.device_id),
                     offset=buffer.data_ptr() - region.addr, header=header, digests=digests, trailer=trailer)
