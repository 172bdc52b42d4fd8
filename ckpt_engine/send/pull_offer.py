"""An owner's side of the ``nixl`` transport: a cached version offered for receivers to pull.

The version's buffer (with several owner ranks, each rank's share) is registered with this process's NIXL
agent once (pool buffers are reused, so later versions find it registered). What a push would put in its
header is encoded once by the lead owner into a small registered buffer of its own, the descriptor, which
pullers read like the buckets: the offer that goes through the control plane stays small whatever the model.
A version is offered as soon as it is cached, before its digests are known: each owner posts the digests its
send takes of the pieces it holds on a board of its own (transport/digest_board.py) as soon as it has them, so
the pulls overlap that pass and no owner waits for another's digests. The caller keeps the version leased
(``VersionCache.lease``) and the descriptors and boards registered for as long as a pull may read them.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from ckpt_engine.codec import encode
from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import CacheError
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners, single_owner
from ckpt_engine.send.cache import CachedVersion
from ckpt_engine.send.transfer import WirePlan
from ckpt_engine.transport.digest_board import board_nbytes, clear, post_digests, post_failure
from ckpt_engine.transport.messages import (
    LayoutMessage,
    PullDescribed,
    PullDescriptor,
    PullOffer,
    PullRegion,
    PullSource,
    PullSpan,
    VersionHeader,
)
from ckpt_engine.transport.nixl import NixlEndpoint, Region


class Board:
    """Where this owner posts the digests of the pieces it holds of one descriptor's wire layout
    (transport/digest_board.py), once its send has computed them (send/own_digests.py). A failure posted first
    stays; once closed (its version released, its memory soon another's) nothing more is written to it."""

    def __init__(self, memory: torch.Tensor, version: int, plan: WirePlan, rank: int) -> None:
        self.memory, self.version, self.plan, self.rank = memory, version, plan, rank  # (memory: registered)
        self._lock = threading.Lock()
        self._failed = self._closed = False
        self.posted = False  # its digests, or a failure

    def post(self, digests: Sequence[int], layout_digest: str, final: bool = True) -> None:
        """Post ``digests``, this owner's of the pieces it holds of wire layout ``layout_digest``, in order (a
        failure instead if they are not of what was offered): ``final``, or only computed (its kept pieces are
        whole; transport/digest_board.py). A computed post after the final one is dropped."""
        pieces = owned_pieces(self.plan, self.rank)
        if layout_digest != self.plan.layout.digest or len(digests) != pieces:
            self.fail(f"owner rank {self.rank}'s send digested {len(digests)} pieces of layout {layout_digest[:12]}, "
                      f"not the {pieces} it offered of {self.plan.layout.digest[:12]}")
            return
        with self._lock:
            if not (self._failed or self._closed or self.posted):
                post_digests(self.memory, self.version, self.plan.layout.digest, digests, final)
                self.posted = final

    def fail(self, reason: str) -> None:
        with self._lock:
            if not self._closed:
                self._failed = self.posted = True
                post_failure(self.memory, self.version, self.plan.layout.digest, reason)

    def close(self, reason: str) -> None:
        """The last write: ``reason`` (a puller still polling stops), then nothing more."""
        self.fail(reason)
        with self._lock:
            self._closed = True


@dataclass(frozen=True)
class Offered:
    offer: PullOffer
    # registered with the endpoint (descriptors and boards): ``endpoint.forget`` each once no pull may read it
    memory: tuple[torch.Tensor, ...] = ()
    # where this owner posts its digests, by board key ("" the whole version's, else a pulled class's key)
    boards: Mapping[str, Board] = field(default_factory=dict)
    # registered with the endpoint: where pulled classes keep their column pieces (send/kept_pieces.py)
    served: tuple[torch.Tensor, ...] = ()

    def fail(self, reason: str) -> None:
        for board in self.boards.values():
            board.fail(reason)

    def close(self, reason: str) -> None:
        for board in self.boards.values():
            board.close(reason)


DescriptorInto = Callable[[int], torch.Tensor]


def offer_version(endpoint: NixlEndpoint, cached: CachedVersion, plans: Mapping[str, WirePlan], *, rank: int,
                  version: int | None = None, algo: DigestAlgo = "xxh3-64",
                  descriptor_into: DescriptorInto | None = None,
                  kept: Mapping[str, torch.Tensor] | None = None) -> Offered:
    """Owner rank ``rank``'s offer of the share ``cached`` holds of its version (all of it, with one owner),
    labelled ``version`` (a re-push: the cached bytes of an older version under a new id; default: its own).
    ``plans``: what goes on the wire, by board key: the whole version (key "", e.g. a sparse version's changes)
    or each pulled class's pieces (by class key). This owner posts the digests its send takes of its pieces of
    each on a board of its own (``Board.post``). The lead (rank 0) also names a descriptor per plan.
    ``descriptor_into(n)``: registered memory of at least n bytes for a descriptor or a board (reused memory
    keeps the agent's metadata, which lists what is registered, the same from version to version; default: new
    memory, registered here). ``kept``: where the sends of pulled classes (by class key) keep their column
    pieces (send/kept_pieces.py), registered here and named in the offer."""
    label = cached.version if version is None else version
    memory: list[torch.Tensor] = []
    boards: dict[str, Board] = {}
    for key, plan in plans.items():
        board = _registered(endpoint, board_nbytes(owned_pieces(plan, rank)), descriptor_into)
        clear(board)
        memory.append(board)
        boards[key] = Board(board, label, plan, rank)
    described: dict[str, PullDescribed] = {}
    if rank == 0:
        cut = _cut_placement(cached) if any(_placement_needed(cached, p.layout) for p in plans.values()) else None
        for key, plan in plans.items():
            placement = cut if _placement_needed(cached, plan.layout) else None
            described[key], descriptor = _describe(endpoint, _header(label, plan, algo), key, descriptor_into,
                                                   placement)
            memory.append(descriptor)
    # (the source last: its metadata lists what is registered, the descriptors and boards included)
    source = _source(endpoint, cached, {key: _wire(endpoint.register(b.memory)) for key, b in boards.items()},
                     {key: _wire(_starting(endpoint, memory)) for key, memory in (kept or {}).items()})
    whole = described.pop("", None)
    return Offered(PullOffer(version=label, sources=[source], descriptor=whole, classes=described), tuple(memory),
                   boards, tuple((kept or {}).values()))


def whole_plan(cached: CachedVersion) -> WirePlan:
    """The whole version ``cached`` is (a share of) as it goes on the wire."""
    whole, owners = _whole_of(cached)
    return WirePlan(whole, owners, dict(cached.aliases), cached.step, {})


def owned_pieces(plan: WirePlan, rank: int) -> int:
    return sum(len(b.slots) for b in plan.layout.buckets if plan.owners.of[b.index] == rank)


@dataclass(frozen=True)
class _Placement:
    """Where the tensors a wire layout is cut from lie in the owners' buffers (see ``PullDescriptor``)."""

    cut_from: LayoutMessage
    cut_from_owners: list[int] | None
    cut_at: list[list[int]] | None


def _placement_needed(cached: CachedVersion, wire: Layout) -> bool:
    """False where the pullers read ``wire``'s buckets as they lie in the shares (the whole version, cached
    whole); else they cut ``wire``'s pieces from where the full tensors lie (``_cut_placement``)."""
    whole, _ = _whole_of(cached)
    return not (cached.is_whole and wire.digest == whole.digest)


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


def whole_layout(cached: CachedVersion) -> Layout:
    """The layout of the full tensors ``cached`` is (a share of): what a class's pieces are cut from."""
    return _whole_of(cached)[0]


def _whole_of(cached: CachedVersion) -> tuple[Layout, Owners]:
    return cached.version_layout or cached.layout, cached.owners or single_owner(cached.layout)


def _header(label: int, plan: WirePlan, algo: DigestAlgo) -> VersionHeader:
    owners = plan.owners
    several = {"owner_ranks": owners.ranks, "owners": list(owners.of)} if owners.ranks > 1 else {}
    return VersionHeader(version=label, mode="cached", digest_algo=algo, layout_digest=plan.layout.digest,
                         layout=LayoutMessage.of(plan.layout), step=plan.step, aliases=dict(plan.aliases),
                         created_at=time.time(), **{**plan.extra, **several})


def _describe(endpoint: NixlEndpoint, header: VersionHeader, board: str, descriptor_into: DescriptorInto | None,
              placement: _Placement | None) -> tuple[PullDescribed, torch.Tensor]:
    """The descriptor of ``header``'s version, encoded into registered memory (returned, to be forgotten once
    no pull reads it)."""
    cut = {} if placement is None else {"cut_from": placement.cut_from, "cut_from_owners": placement.cut_from_owners,
                                        "cut_at": placement.cut_at}
    raw = encode(PullDescriptor(header=header, board=board, **cut))
    descriptor = _registered(endpoint, len(raw), descriptor_into)
    descriptor[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    where = endpoint.register(descriptor)
    return PullDescribed(region=_wire(where), nbytes=len(raw), digest=xxhash.xxh3_64_hexdigest(raw)), descriptor


def _registered(endpoint: NixlEndpoint, nbytes: int, into: DescriptorInto | None) -> torch.Tensor:
    """Registered memory of at least ``nbytes``, starting its region (an offer names a region's start)."""
    memory = torch.empty(nbytes, dtype=torch.uint8) if into is None else into(nbytes)
    _starting(endpoint, memory)
    return memory


def _starting(endpoint: NixlEndpoint, memory: torch.Tensor) -> Region:
    """``memory``'s region, registered; a CacheError unless it starts there (an offer names a region's start)."""
    region = endpoint.register(memory)
    if memory.data_ptr() != region.addr:
        raise CacheError("a descriptor, board or kept pieces must start their registered memory")
    return region


def _wire(region: Region) -> PullRegion:
    return PullRegion(addr=region.addr, nbytes=region.nbytes, mem=region.mem, device_id=region.device_id)


def _source(endpoint: NixlEndpoint, cached: CachedVersion, boards: Mapping[str, PullRegion],
            kept: Mapping[str, PullRegion]) -> PullSource:
    """Every buffer ``cached`` reads, registered (pool buffers are reused: most are registered already)."""
    spans = []
    for buffer in cached.buffers:
        region = endpoint.register(buffer)
        spans.append(PullSpan(region=_wire(region), offset=buffer.data_ptr() - region.addr))
    return PullSource(agent=base64.b64encode(endpoint.metadata()),  # (its wire form)
                      region=spans[0].region, offset=spans[0].offset, more=spans[1:], boards=dict(boards),
                      kept=dict(kept))
