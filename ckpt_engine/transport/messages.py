"""Messages that travel between sender and receivers, as typed msgpack maps (never pickle).

Rules that keep older peers working: unknown fields are ignored, every field added after protocol 1 is
optional with a safe default, and required fields are only ever added with a new ``proto`` number.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Base64Bytes, BaseModel, ConfigDict, Field

from ckpt_engine.codec import MAX_MESSAGE_BYTES
from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan.layout import Layout, TensorSpec, check_same_layout, plan_layout
from ckpt_engine.plan.modes import Mode

PROTO_VERSION = 1
# A version with tensors larger than a bucket (sent in pieces) opens with this protocol number: a receiver
# that cannot put pieces together refuses it at the first frame ("protocol 2 is not supported").
PROTO_CHUNKED = 2
SUPPORTED_PROTOS = (PROTO_VERSION, PROTO_CHUNKED)



class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class LayoutMessage(_Message):
    """A layout as columns (cheap to encode and validate for tens of thousands of tensors)."""

    bucket_size: int = Field(gt=0)
    alignment: int = Field(gt=0)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    digest: str
    groups: list[int] | None = None  # planned by owner groups (a sparse version of several owners)

    @classmethod
    def of(cls, layout: Layout) -> LayoutMessage:
        slots = layout.slots
        return cls(
            bucket_size=layout.bucket_size,
            alignment=layout.alignment,
            names=[s.name for s in slots],
            dtypes=[s.dtype for s in slots],
            shapes=[list(s.shape) for s in slots],
            digest=layout.digest,
            groups=list(layout.groups) if layout.groups is not None else None,
        )

    def to_layout(self) -> Layout:
        """Re-plan locally and check the result against the sender's digest."""
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ProtocolError("layout columns names/dtypes/shapes differ in length")
        if self.groups is not None and len(self.groups) != len(self.names):
            raise ProtocolError("layout groups and names differ in length")
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtypes, self.shapes)]
        layout = plan_layout(specs, self.bucket_size, self.alignment, self.groups)
        check_same_layout(layout, self.digest, peer="sender")
        return layout


class VersionHeader(_Message):
    """``layout`` may be omitted when it equals the previous version's on the same group: receivers keep
    the layouts they were sent, keyed by ``layout_digest``."""

    proto: int = PROTO_VERSION
    version: int = Field(ge=0)
    mode: Mode
    digest_algo: str
    layout_digest: str
    layout: LayoutMessage | None = None
    step: int | None = None
    aliases: dict[str, str] = Field(default_factory=dict)
    created_at: float | None = None
    # Sparse versions: only changed tensors are laid out and sent, relative to ``base_version``; the whole
    # model (full layout) has ``full_version_digest`` once they are applied.
    base_version: int | None = None
    full_layout_digest: str | None = None
    full_version_digest: str | None = None
    skipped: int = 0
    # Versions of several trainer ranks: the rank that sends each bucket (on its own sync group); None: rank 0
    # sends everything
    owner_ranks: int = 1
    owners: list[int] | None = None


class VersionTrailer(_Message):
    version: int
    version_digest: str


class AbortMessage(_Message):
    version: int
    reason: str


class Ack(_Message):
    """A rank's outcome for one version, exchanged by every rank of the group after the version ends."""

    version: int
    rank: int
    ok: bool
    version_digest: str | None = None
    reason: str | None = None
    bad_tensors: list[str] = Field(default_factory=list)
    seconds: dict[str, float] = Field(default_factory=dict)


# Owner ranks one pulled version may come from (each source carries its NIXL agent's metadata).
MAX_PULL_OWNERS = 256
MAX_PULL_CLASSES = 256  # (as many as a sharded version has classes)
MAX_PULL_BUFFERS = 1024  # (a delta's buffers: at most the versions a cache keeps)


class PullRegion(_Message):
    """Memory an owner registered with its NIXL agent (transport/nixl.py ``Region``)."""

    addr: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    mem: Literal["DRAM", "VRAM"]
    device_id: int = Field(0, ge=0)


class PullDescriptor(_Message):
    """What a pushed version brings in its header, for a pull (with the owner of every bucket when several
    trainer ranks own the version), and which of the owners' boards its digests are posted on. A version is
    offered as soon as it is cached: each owner then digests the pieces it holds and posts them on its own board
    (``PullSource.boards``, transport/digest_board.py) while the pulls already read. Every bucket is checked
    against its owner's digests as it lands, and the version digest (a push's trailer) is computed from them.
    The puller reads it from the lead owner's memory: its size grows with the tensor count, so it never goes
    through the control plane."""

    header: VersionHeader
    board: str = Field("", max_length=64)
    # A sharded class's pull: its pieces are cut by the puller from the owners' shares of the version, which
    # are laid out as this layout, with these owners (None: one owner). None: the header's layout is the shares'.
    cut_from: LayoutMessage | None = None
    cut_from_owners: list[int] | None = None
    # Where each tensor of ``cut_from`` lies, in its order: [buffer, byte offset in that buffer] of the one
    # owner's (a delta's tensors lie in several buffers). None: buffer 0, as the shares are laid out.
    cut_at: list[list[int]] | None = None


class PullSpan(_Message):
    """One more registered buffer of an owner: the region holding it, and where in it the buffer starts."""

    region: PullRegion
    offset: int = Field(ge=0)


class PullSource(_Message):
    """One owner rank's share of an offered version: how to reach its NIXL agent, and the registered region that
    holds the share (the share's bucket b at ``offset`` + b's flat offset in the share: plan/owners.py
    ``share_offsets``). With one owner the share is the whole version."""

    agent: Base64Bytes = Field(max_length=1 << 20)
    region: PullRegion
    offset: int = Field(ge=0)
    # A delta's other buffers (buffer 1, 2, ...: those of the versions it shares unchanged tensors with)
    more: list[PullSpan] = Field(default_factory=list, max_length=MAX_PULL_BUFFERS)
    # Where this owner posts the digests of the pieces it holds, once it has computed them, per descriptor (its
    # ``board`` key: "" for the whole version, else a pulled class's key): transport/digest_board.py
    boards: dict[Annotated[str, Field(max_length=64)], PullRegion] = Field(default_factory=dict,
                                                                          max_length=MAX_PULL_CLASSES)
    # Where this owner keeps the column pieces of each pulled class (by class key), back to back from the
    # region's start once it posted that class's digests: plan/pull_reads.py ``kept_spans``
    kept: dict[Annotated[str, Field(max_length=64)], PullRegion] = Field(default_factory=dict,
                                                                        max_length=MAX_PULL_CLASSES)


class PullDescribed(_Message):
    """Where the lead owner's encoded ``PullDescriptor`` lies (``nbytes`` at ``region``'s start), with that
    encoding's xxh3-64 digest (hex)."""

    region: PullRegion
    nbytes: int = Field(gt=0, le=MAX_MESSAGE_BYTES)
    digest: str = Field(pattern="^[0-9a-f]{16}$")


class PullOffer(_Message):
    """A version served for receivers to pull (the ``nixl`` transport), small whatever the model: each owner
    rank's source, by rank, and the descriptor in the lead's (rank 0's) memory. An owner rank other than the
    lead offers its own source alone, without a descriptor: the daemon joins the owners' offers into one. The
    lead of a sharded version offers one descriptor per pulled class instead."""

    version: int
    sources: list[PullSource] = Field(min_length=1, max_length=MAX_PULL_OWNERS)
    descriptor: PullDescribed | None = None
    # A sharded version: each pulled class's descriptor, by class key (the daemon gives each puller its class's
    # as ``descriptor``)
    classes: dict[str, PullDescribed] = Field(default_factory=dict, max_length=MAX_PULL_CLASSES)
