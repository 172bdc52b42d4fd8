"""Control-plane messages between agents (trainer ranks, receivers), callers and the daemon, over ZMQ.

A frame is one msgpack (or JSON, if it starts with ``{``) map: ``{"id": int, "type": str, "body": {...}}``.
Replies echo the id: ``{"id", "ok": true, "body": {...}}`` or ``{"id", "ok": false, "error", "detail"}``.
Never pickle; frames over ``max_bytes`` are refused before parsing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgpack
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.config import JsonDict

from ckpt_engine.control.auth import TOKEN_MAX_LENGTH
from ckpt_engine.errors import ConfigError, ProtocolError
from ckpt_engine.plan.modes import DEFAULT_STAGING, Mode, Staging
from ckpt_engine.plan.shards import ShardSpec, Slice, spec_from_wire, spec_to_wire
from ckpt_engine.ranks import QuorumRank
from ckpt_engine.transport.messages import PullOffer

Role = Literal["trainer", "receiver", "driver"]
# A version's lifecycle in the daemon: requested -> snapshotting -> transferring -> verifying -> one of TERMINAL.
# interrupted: the daemon stopped before the version's outcome was known (receivers may hold it)
VersionStatus = Literal["requested", "snapshotting", "transferring", "verifying", "committed", "failed", "cancelled",
                        "interrupted"]
STATUSES: tuple[str, ...] = VersionStatus.__args__  # type: ignore[attr-defined]
TERMINAL: tuple[str, ...] = ("committed", "failed", "cancelled", "interrupted")
Encoding = Literal["msgpack", "json"]
# Version ids and steps: exact in every JSON parser (2**53) and within SQLite's INTEGER, so a larger value is a
# validation error, never an OverflowError deep in the history store.
MAX_ID = (1 << 53) - 1
def _not_bool(value: object) -> object:
    # JSON's true is not the number 1 here (pydantic's lax mode would take it as one)
    if isinstance(value, bool):
        raise ValueError("expected an integer, got a boolean")
    return value


def plain_int(value: object) -> object:
    """An integer, or text (an HTTP path or query value) that is only ASCII digits with an optional minus:
    pydantic's lax mode would also read ' 1', '1.0' and '1_0' as numbers."""
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value, flags=re.ASCII):
        raise ValueError("expected an integer in decimal digits")
    return _not_bool(value)


def _clipped(limit: int):
    def clip(value: object) -> object:
        return value[: limit - 3] + "..." if isinstance(value, str) and len(value) > limit else value
    return BeforeValidator(clip)


# Why something failed, as a peer tells it: a longer text is cut, never refused (a report refused for its reason's
# length left a version in flight until its time limit, with nobody benched: issue 35)
Reason = Annotated[Annotated[str, Field(max_length=20000)] | None, _clipped(20000)]  # (REASON_CHARS)
ShortReason = Annotated[Annotated[str, Field(max_length=2000)] | None, _clipped(2000)]  # (SHORT_REASON_CHARS)


REASON_CHARS, SHORT_REASON_CHARS = 20000, 2000


def clip_text(value: str | None, limit: int) -> str | None:
    """``value`` cut to ``limit`` characters (marked), as the daemon would cut it."""
    return value[: limit - 3] + "..." if value is not None and len(value) > limit else value


def clip_reasons(body: dict[str, Any]) -> dict[str, Any]:
    """A report or poll body with its reasons cut to what the daemon keeps, before it is sent: a reason of
    megabytes (an engine's traceback) would make a frame the daemon drops, connection and all."""
    out = dict(body)
    for key, limit in (("reason", REASON_CHARS), ("unable", SHORT_REASON_CHARS), ("staging_why", SHORT_REASON_CHARS)):
        if isinstance(out.get(key), str):
            out[key] = clip_text(out[key], limit)
    for key in ("receivers", "classes"):
        if isinstance(out.get(key), list):
            out[key] = [{**item, "reason": clip_text(item["reason"], REASON_CHARS)}
                        if isinstance(item, dict) and isinstance(item.get("reason"), str) else item
                        for item in out[key]]
    return out


# (the validator after the bounds: it still runs first, and the bounds stay minimum/maximum in the JSON schema)
WireInt = Annotated[int, Field(ge=-MAX_ID, le=MAX_ID), BeforeValidator(_not_bool)]
Step = Annotated[int, Field(ge=0, le=MAX_ID), BeforeValidator(_not_bool)]
MAX_KEPT = 4  # versions the daemon asks the trainer to keep for repairs (what receivers serve), at most
MAX_LISTED_VERSIONS = 1024  # an agent holds a handful of versions; the cap bounds what one frame can make us store
# Counts and sizes a peer reports: what the history stores must fit its integer columns (and JSON's exact range).
Count = Annotated[int, Field(ge=0, le=MAX_ID)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
StageName = Annotated[str, Field(max_length=64)]
MAX_STAGES = 64
MAX_RANKS = 1 << 16
# Secrets and ids the daemon issues, and names agents choose: bounded, printable, no spaces.
Secret = Annotated[str, Field(min_length=16, max_length=128, pattern=r"^[\x21-\x7e]+$")]
AgentId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")]
EngineName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/@-]+$")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Sharded delivery (plan/shards.py): what a receiver keeps of each tensor it names, [dim, start, length] slices.
MAX_SPEC_TENSORS = 1 << 16
MAX_CLASSES = 256  # receiver classes of one version (TP ranks x pipeline stages)
TensorName = Annotated[str, Field(min_length=1, max_length=512)]
WireSlice = Annotated[list[Annotated[int, Field(ge=0, le=MAX_ID), BeforeValidator(_not_bool)]],
                      Field(min_length=3, max_length=3)]
WireShardSpec = Annotated[dict[TensorName, Annotated[list[WireSlice], Field(min_length=1, max_length=4096)]],
                          Field(max_length=MAX_SPEC_TENSORS)]
_WIRE_SPEC = TypeAdapter(WireShardSpec)


def parse_shard_spec(value: Any) -> ShardSpec:
    """The one reader of a shard spec, wherever it comes from (a message, a framework's metadata, a caller's
    typed spec): its bounds, then its slices, checked and sorted; a ConfigError says what is wrong."""
    if isinstance(value, Mapping) and all(isinstance(v, (tuple, list)) and all(isinstance(s, Slice) for s in v)
                                          for v in value.values()):
        value = spec_to_wire(value)  # a typed spec: checked by the same rules as one read from the wire
    try:
        return _read_spec(value)
    except ValidationError as exc:
        raise ConfigError(f"shard spec: {exc.errors()[0]['msg']} at {exc.errors()[0]['loc']}") from None


def _read_spec(wire: Any) -> ShardSpec:
    return spec_from_wire(_WIRE_SPEC.validate_python(wire, strict=True))  # (ints are ints, on every plane)


def _parsed_spec(value: Any) -> ShardSpec:
    if isinstance(value, dict) and all(isinstance(v, tuple) for v in value.values()):
        return value  # already typed (parsed where it came in, e.g. a registration the daemon then plans with)
    try:
        return _read_spec(value)
    except ConfigError as exc:  # (pydantic reports a ValueError with the message's own location)
        raise ValueError(str(exc)) from None


# A shard spec as every message carries it: parsed once, where the message is read, into the typed spec
ShardSpecField = Annotated[ShardSpec, PlainValidator(_parsed_spec, json_schema_input_type=WireShardSpec),
                           PlainSerializer(spec_to_wire)]
# A class's sync group within a generation (transport/group.py ``part``)
ClassPart = Annotated[str, Field(max_length=32, pattern=r"^(class-[0-9]{1,4}/)?$")]


class ClassLane(BaseModel):
    """Send of a sharded version: one class of receivers with identical specs, on a sync group of its own
    (``part``): the trainer is rank 0, the class's receivers ranks 1.. in the order of ``ranks`` (their ranks in
    the version's quorum, which the trainer's report uses); its colocated receivers (``ipc_peers``: agent id ->
    quorum rank) take the same-host path instead. A class of colocated or pulling receivers only has no group."""

    model_config = ConfigDict(extra="ignore")
    key: str = Field(max_length=64)
    part: ClassPart
    spec: ShardSpecField = Field(default_factory=dict)
    ranks: list[Annotated[QuorumRank, Field(ge=1, le=MAX_RANKS)]] = Field(default_factory=list, max_length=MAX_RANKS)
    ipc_peers: dict[Annotated[str, Field(max_length=64)], Annotated[QuorumRank, Field(ge=1, le=MAX_RANKS)]] = Field(
        default_factory=dict, max_length=MAX_RANKS)
    # its receivers that pull their pieces over nixl (quorum ranks): no seat in its group; the trainer offers the
    # class's descriptor once its digests are known
    pullers: list[Annotated[QuorumRank, Field(ge=1, le=MAX_RANKS)]] = Field(default_factory=list,
                                                                           max_length=MAX_RANKS)

    @model_validator(mode="after")
    def _has_receivers(self) -> ClassLane:
        if not self.ranks and not self.ipc_peers and not self.pullers:
            raise ValueError(f"class {self.key[:12]} has no receivers")
        return self


class ClassDone(BaseModel):
    """One class's outcome in a trainer's ``done`` report of a sharded version."""

    model_config = ConfigDict(extra="ignore")
    key: str = Field(max_length=64)
    ok: bool
    reason: Reason = None
    version_digest: str | None = Field(None, max_length=64)  # over exactly the class's pieces
    bytes: Count = 0
    spec_unfit: bool = False  # the class's shard spec does not fit the version (its receivers' to fix)
    rendezvous_failed: bool = False  # the class's sync group did not form


class Register(_Body):
    role: Role
    rank: int = Field(0, ge=0, le=1 << 20)
    host: str = Field(max_length=256)
    pid: int = Field(ge=0, le=1 << 32)
    device: str = Field(max_length=64)
    # Versions this agent holds, numbered by the history ``history_id`` names; versions of another history
    # (the daemon lost or replaced its file) mean nothing here and are ignored.
    versions: list[WireInt] = Field(default_factory=list, max_length=MAX_LISTED_VERSIONS)
    history_id: str | None = Field(None, max_length=64)
    # (any string up to a token's length: one that is no valid token is refused as unauthorized, not as malformed)
    token: str | None = Field(None, max_length=TOKEN_MAX_LENGTH)
    host_id: str | None = Field(None, max_length=256)  # ipc.host_identity(): equal ids can use the same-host path
    sync_every: int = Field(1, ge=1, le=1 << 20)  # receivers: take only every N-th version (slow engines)
    # trainers registering again (daemon restart, expired heartbeat): the same-host hub they already serve,
    # which colocated receivers must keep being sent to
    ipc_name: str | None = Field(None, max_length=200, pattern=r"^ckpt-engine/[\x21-\x7e]+$")
    # Engines of several workers (vLLM with tensor parallelism): receivers naming the same engine apply a
    # version together. ``driven`` receivers stage a verified version until the engine's driver applies it;
    # the driver names its engine and how many receivers it has.
    engine: EngineName | None = None
    driven: bool = False
    members: int | None = Field(None, ge=1, le=4096)
    # receivers whose engine cannot take a sparse version (vLLM rebuilds every layer it loads): versions sent
    # to a quorum with one of them are whole
    whole_versions: bool = False
    # trainer rank 0: ranks of the trainer job (each can own a share of every version)
    trainer_ranks: int | None = Field(None, ge=1, le=1 << 16)
    # A driven worker: the key its engine's driver was issued (RegisterReply.engine_key), which admits it as a
    # worker of that engine (a rollout-token holder without it cannot take a worker's place)
    engine_key: str | None = Field(None, max_length=128, pattern=r"^[\x21-\x7e]+$")
    # A framework (verl) moves this agent's versions on its own schedule and groups: the daemon numbers them,
    # judges the receivers' own reports and keeps the history, but assigns such receivers nothing (no
    # catch-up, no version of its own) and starts versions of such a trainer only when it asks (see SyncRequest
    # ``receivers``); a re-push (rollback) waits for the framework's next sync.
    framework: Literal["verl"] | None = None
    # Receivers: their own staging policy (receive/staging.py), over the deployment's
    staging: Staging | None = None
    # Receivers: the slices of tensors they keep (tensor-parallel ranks); None: every tensor whole
    shard_spec: ShardSpecField | None = None
    # Receivers: pull every version over NIXL whatever the deployment's transport (it must trust its receivers
    # with the trainer's memory: nixl_trust_receivers)
    transport: Literal["nixl"] | None = None


class RegisterReply(_Body):
    agent_id: str
    session: str  # proves later messages come from this registration; only this agent has it
    history_id: str  # the history that numbers the versions this daemon assigns
    ipc_name: str | None = None  # trainers: the name to serve colocated receivers under
    heartbeat_s: float
    group_name: str
    store_host: str
    store_port: int
    bucket_size: int
    alignment: int
    keep_versions: int
    verify: bool
    connect_timeout_s: float
    collective_timeout_s: float
    ack_timeout_s: float
    version_timeout_s: float
    engine_key: str | None = None  # drivers: what their engine's workers register with (Register.engine_key)
    # receivers: the staging policy to apply (theirs if they named one, else the deployment's)
    staging: Staging = DEFAULT_STAGING
    staging_share: float = 0.5
    staging_budget: int | None = None  # bytes auto staging considers free instead of measuring
    # the deployment's transport: under ``nixl`` agents start their NIXL agent at registration, not at the
    # first pull (importing and starting it takes a second or two)
    transport: str = "auto"


def longest_poll_wait(heartbeat_s: float) -> float:
    """How long a poll may wait at the daemon, given the heartbeat timeout: the wait and half a heartbeat (for
    the reply and the next poll to arrive) stay within the heartbeat, so an agent waiting in its polls is never
    taken for a silent one. Both sides clamp to it (the daemon logs what it clamped)."""
    return heartbeat_s / 2


class Poll(_Body):
    """Heartbeat and request for work in one: the daemon answers when it has an assignment or after wait_s."""

    agent_id: AgentId
    session: Secret
    versions: list[WireInt] = Field(default_factory=list, max_length=MAX_LISTED_VERSIONS)
    wait_s: float = Field(1.0, ge=0, le=30)
    # The key of the assignment the previous poll's reply carried: assignments are delivered at least once,
    # kept by the daemon until the agent says it got them (a reply can be lost with a connection or arrive
    # after the agent gave up on its request).
    received: str | None = Field(None, max_length=64)
    # Receivers: why it cannot take versions now (e.g. its receive thread died before any version); it is left
    # out of the quorum for a while
    unable: ShortReason = None


class Assignment(_Body):
    # discard: a driven receiver drops the staged ``version`` (its engine's driver could not apply it)
    kind: Literal["send", "receive", "evict", "apply", "discard"]
    version: int
    mode: Mode = "cached"
    step: int | None = None
    source_version: int | None = None  # send: re-push this cached version under ``version``
    generation: int = 0
    world_size: int = 0  # of the collective sync group (1: no collective receivers)
    rank: int = 0
    transport: Literal["collective", "ipc", "nixl"] = "collective"  # receive: how this receiver gets the version
    offer: PullOffer | None = None  # receive over nixl: what to pull from whom (the trainer's offer)
    pullers: int = Field(0, ge=0, le=MAX_RANKS)  # send: receivers that pull the version (the trainer offers it)
    ipc_name: str | None = None  # receive over ipc: the trainer's hub
    ipc_peers: dict[str, int] = Field(default_factory=dict)  # send: colocated receivers (agent id -> rank)
    sparse_base: int | None = None  # send: only changes since this version, which every receiver holds
    sparse: bool = False  # send: snapshot only what changed since the previous cached version (shared in cache)
    reason: ShortReason = None  # discard: why
    # trainer ranks that own shares of the version (each sends its buckets on its own group with the
    # receivers; receivers join one group per owner); 1: the trainer's rank 0 sends everything
    owners: int = Field(1, ge=1, le=1 << 16)
    # send of a re-push: the digest the history recorded for ``source_version`` when it committed (the cached
    # copy is checked against it before anything is sent)
    expected_digest: str | None = Field(None, max_length=64)
    # send: cached versions the trainer ranks must not evict to make room (what receivers serve: a repair or a
    # catch-up re-sends them), newest first
    keep: list[int] = Field(default_factory=list, max_length=MAX_KEPT)
    # A sharded version (receivers declared shard specs): receive: the class's sync group (``rank`` and
    # ``world_size`` are the class group's); send: every class (the trainer sends each only its pieces)
    part: ClassPart = ""
    classes: list[ClassLane] = Field(default_factory=list, max_length=MAX_CLASSES)
    # Not on the wire: the agent id this assignment was polled under. After a daemon restart the agent has a
    # new id, and what the old daemon assigned will not be served (the new one marked it failed).
    _received_as: str | None = PrivateAttr(default=None)

    @property
    def received_as(self) -> str | None:
        return self._received_as

    def receipt(self, agent_id: str) -> Assignment:
        self._received_as = agent_id
        return self

    def key(self) -> str:
        """Identifies the assignment for acknowledgement and de-duplication (one of each kind per version)."""
        return f"{self.kind}:{self.version}"


class PollReply(_Body):
    assignment: Assignment | None = None
    # the version the daemon has in flight as it answers (None: none): a trainer releases what it offered of
    # versions that ended
    in_flight: WireInt | None = None


class ReceiverAck(BaseModel):
    """One receiver's outcome inside a trainer's ``done`` report (other fields are kept as sent)."""

    model_config = ConfigDict(extra="allow")
    rank: int = Field(ge=0, le=MAX_RANKS)
    ok: bool
    version_digest: str | None = Field(None, max_length=64)
    reason: Reason = None
    seconds: dict[StageName, Seconds] = Field(default_factory=dict, max_length=MAX_STAGES)


ReportEvent = Literal["snapshotting", "transferring", "verifying", "offered", "done", "received", "evicted", "staged",
                      "applied"]


class Report(_Body):
    """What an agent tells the daemon about a version it works on. Trainers report the stages and ``done``;
    receivers ``staged`` (verified, waiting for their engine's driver) and ``received`` (their own outcome,
    with the digest they computed); drivers ``applied`` (the engine's outcome)."""

    agent_id: AgentId
    session: Secret
    version: WireInt
    event: ReportEvent
    step: WireInt | None = None  # the training step at which the trainer served the version
    ok: bool | None = None
    reason: Reason = None
    version_digest: str | None = Field(None, max_length=64)
    bytes: Count = 0
    buckets: Count = 0
    tensors: Count = 0
    tensors_skipped: Count = 0
    bytes_skipped: Count = 0
    stages: dict[StageName, Seconds] = Field(default_factory=dict, max_length=MAX_STAGES)
    receivers: list[ReceiverAck] = Field(default_factory=list, max_length=MAX_RANKS)
    cache_versions: list[WireInt] | None = Field(None, max_length=MAX_LISTED_VERSIONS)
    cache_bytes: Count | None = None
    group_broken: bool = False
    # Trainers: quorum ranks of the receivers that never joined the rendezvous (they are benched, not the others)
    absent_ranks: list[Annotated[QuorumRank, Field(ge=1, le=MAX_RANKS)]] = Field(default_factory=list,
                                                                                 max_length=MAX_RANKS)
    # Trainers: the version's sync group did not form (whether or not anyone could be named absent)
    rendezvous_failed: bool = False
    # Receivers and drivers: the model was changed part way and holds no whole version (a failed apply);
    # ``serving``: the version the model holds whole after this event (None: none, or unknown).
    torn: bool = False
    serving: WireInt | None = None
    # Receivers: why this agent cannot take versions at all for now (e.g. staging memory); it leaves the
    # quorum for a while instead of failing every version.
    unable: ShortReason = None
    # Receivers: where the version was held (``shared``: read where the sender holds it) and why
    staging: Literal["device", "host", "stream", "shared"] | None = None
    staging_why: ShortReason = None
    # Trainers, of a sharded version: each class's outcome and digest (``version_digest``: the whole version's)
    classes: list[ClassDone] = Field(default_factory=list, max_length=MAX_CLASSES)
    # Trainers, event ``offered``: the version ready to be pulled over nixl (handed on to its pullers)
    offer: PullOffer | None = None


class Unregister(_Body):
    agent_id: AgentId
    session: Secret


# sparse works from the host cache, bypass_cpu skips it: a request asking for both is refused (the controller
# also refuses one of them coming from the deployment's defaults); the schema says so too.
_NOT_SPARSE_AND_BYPASS: JsonDict = {"not": {"required": ["sparse", "bypass_cpu"],
                                  "properties": {"sparse": {"const": True}, "bypass_cpu": {"const": True}}}}


class SyncRequest(BaseModel):
    """A request for a new version: the body of ``POST /sync`` and of the ZMQ ``sync`` message alike. An unknown
    key is refused (a typo such as ``"bypass": true`` must not quietly become a cached version)."""

    # strict: "1" and 1.0 are no step, "yes" no bool (JSON bodies and frames carry typed values)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_NOT_SPARSE_AND_BYPASS)
    step: Step | None = Field(None, description="trainer step this version belongs to")
    bypass_cpu: bool | None = Field(None, description="override the deployment's bypass_cpu for this version")
    sparse: bool | None = Field(None, description="send only tensors changed since the version every receiver "
                                "holds (default: the deployment's sparse)")
    wait: bool = Field(False, description="answer with the final record instead of at once")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="how long to wait when wait is true")


class FrameworkSyncRequest(SyncRequest):
    """The ZMQ ``sync`` of a framework-driven trainer (verl's actor rank 0) opening its own sync's version; not
    on HTTP, where ``receivers`` is refused as an unknown key."""

    receivers: list[AgentId] | None = Field(
        None, min_length=1, max_length=4096, json_schema_extra={"uniqueItems": True}, description="the receivers "
        "(agent ids, in the order of their ranks 1..n on the framework's groups) that take this version")
    # who opens it: the framework's trainer rank 0 itself (its registration), not any trainer-token holder
    agent_id: AgentId | None = None
    session: Secret | None = None
    limit_s: float | None = Field(None, gt=0, le=7 * 86400, description="how long the daemon gives this version "
                                  "before failing it (the framework's own timeouts; default timeouts.version_s)")
    # the knobs the framework set (ckpt_engine/config/knobs.py KNOBS; checked there as the deployment's YAML is): the
    # daemon settles them against its deployment, records them and answers with what the sync runs with
    knobs: dict[Literal["bypass_cpu", "sparse", "staging", "bucket_size_mb", "keep_versions"],
                bool | int | float | str] | None = Field(None, max_length=5)


VersionId = WireInt


class VersionsQuery(BaseModel):
    """Reading the history: ``GET /versions`` (its query) and the ZMQ ``versions`` message, one model for both."""

    # (a query string's values are text: digits only, so limit=1.0 is refused as /versions/1.0 is)
    limit: Annotated[int, Field(ge=1, le=1000), BeforeValidator(plain_int)] = 50
    status: VersionStatus | None = None
    before: Annotated[int, Field(ge=1, le=MAX_ID, description="only versions with a smaller id"),
                      BeforeValidator(plain_int)] | None = None


class LatestQuery(BaseModel):
    """``GET /versions/latest`` and the ZMQ ``latest`` message."""

    status: VersionStatus | None = None


class VersionRef(BaseModel):
    """One version by id: ``/versions/{version}`` (get, push, evict) and the ZMQ ``version``, ``push``, ``evict``."""

    version: VersionId


def encode_frame(message: dict[str, Any], encoding: Encoding = "msgpack") -> bytes:
    if encoding == "json":
        return json.dumps(message).encode()
    return msgpack.packb(message, use_bin_type=True)


def decode_frame(raw: bytes, max_bytes: int) -> tuple[dict[str, Any], Encoding]:
    """Parse one frame; raises ProtocolError for anything oversized, undecodable or not a map."""
    if len(raw) > max_bytes:
        raise ProtocolError(f"frame of {len(raw)} bytes exceeds the limit of {max_bytes}")
    encoding: Encoding = "json" if raw[:1] == b"{" else "msgpack"
    try:
        data = json.loads(raw) if encoding == "json" else msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError,
            RecursionError) as exc:  # RecursionError: JSON nested deeper than the interpreter's stack
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError(f"a frame must be a map, got {type(data).__name__}")
    return data, encoding


def parse_body(kind: type[BaseModel], body: Any, *, strict: bool | None = None) -> Any:
    """``strict``: no coercion (a typed frame's "1" is not the number 1; an HTTP query string's is)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.__name__}: body must be a map")
    try:
        return kind.model_validate(body, strict=strict)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ProtocolError(f"{kind.__name__}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc
