"""The sending side of a version: fills buckets (from the cache or straight from live tensors), digests them,
and broadcasts them double-buffered, so bucket k+1 is being filled while bucket k is on the wire.

A transfer runs on a thread of its own; the publisher's background sends run it inline on theirs.

In a version of several owners (plan/owners.py), every trainer rank sends the buckets it owns on its own sync
group, where it is rank 0. The receivers are the same ranks in every group. Rank 0 leads: it sends the
version's header and trailer and collects the acknowledgements on its group. The owners vote before the first
bucket and after their last (owners_vote.py). If any owner fails, the lead ends the version with an abort, so
receivers never load it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ckpt_engine.codec import encode
from ckpt_engine.device import DeviceInfo, DigestAlgo, comm_empty, current_stream, new_stream, on_stream, set_current
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError, ReceiversAbsent
from ckpt_engine.plan.hashing import bucket_digests, version_digest
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.owners import Owners
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import TensorsOrProvider, check_matches_layout, forget_fill_views
from ckpt_engine.ranks import plain_seat
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.outlets import CollectiveOutlet, IpcOutlet, LayoutSent, Outlet, Seats
from ckpt_engine.send.owners_vote import Aborted, NotReady, OwnersVote
from ckpt_engine.send.sources import (
    CacheSource,
    LiveSource,
    PiecesChangesSource,
    Source,
    SparseCacheSource,
    StaleCopy,
    check_identity,
    evict_quietly,
    record_identity,
)
from ckpt_engine.send.transfer import KeepFor, Kept, Transfer, TransferResult, WirePlan
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import (
    PROTO_CHUNKED,
    PROTO_VERSION,
    AbortMessage,
    Ack,
    LayoutMessage,
    VersionHeader,
    VersionTrailer,
)
from ckpt_engine.transport.same_host import IpcHub

log = logging.getLogger(__name__)
_MANIFESTS_KEPT = 8

# Called with (bucket index, bucket bytes) after the digests are taken; returns the bytes to put on the wire.
# Fault injection for tests and chaos runs: the source (cache or live tensors) is never modified by it.
WireHook = Callable[[int, torch.Tensor], torch.Tensor]
Digested = Callable[[int, str, str, list[int], bool], None]  # see Sender


class Sender:
    """Sends versions as the source (rank 0) of a sync group, to colocated receivers through an IPC hub, or
    both in the same version. ``ipc_peers`` maps the colocated receivers' agent ids to their ranks."""

    def __init__(self, group: SyncGroup | None, *, device: DeviceInfo | None = None, hub: IpcHub | None = None,
                 ipc_peers: Mapping[str, int] | None = None, digest_algo: DigestAlgo | None = None,
                 ack_timeout_s: float | None = None, wire_hook: WireHook | None = None,
                 on_stage: Callable[[int, str], None] | None = None, timeout_s: float = 60.0,
                 manifests: dict[int, Manifest] | None = None, owners_group: SyncGroup | None = None,
                 slots_key: str = "", seats: Seats = plain_seat, digested: Digested | None = None) -> None:
        """``owners_group``: the trainer ranks that own shares of this sender's versions, rank 0 leading. This
        rank is ``owners_group.rank``. None means this rank sends every bucket itself.
        ``slots_key``: which of the hub's shared slots its colocated receivers read; each class of a sharded
        version has its own. ``seats``: the quorum rank each receiver of ``group`` is acknowledged under.
        With neither a group nor colocated receivers (every receiver pulls, or there is none), the sender
        still digests what it caches. ``digested``: called with (version, ``slots_key``, layout digest, this
        rank's digests, final) once this rank sent (and kept) its buckets of a version, then final once the
        owners agreed that every one sent its buckets (its pullers read them: send/own_digests.py). Pullers
        load only once every owner's final post is there: an owner that posted and then stalled before the vote
        would leave them serving a version its trainer failed."""
        if owners_group is not None and ipc_peers:
            raise ConfigError("versions of several owners go on sync groups only (no colocated receivers)")
        self.owners_group = owners_group
        self.votes = OwnersVote(owners_group, self._abort_receivers)
        self.rank = self.votes.rank
        self.lead = self.rank == 0
        if ipc_peers and hub is None:
            raise ConfigError("colocated receivers need an IPC hub")
        self.group = group
        self.channel = Channel(group) if group is not None else None
        if self.channel is not None and not self.channel.is_src:
            raise ProtocolError(f"rank {group.rank} cannot send: the sender is rank {self.channel.src}")  # type: ignore[union-attr]
        self.device: DeviceInfo = group.device if group is not None else device  # type: ignore[assignment]
        if self.device is None:
            raise ConfigError("a sender without a sync group needs a device")
        self.hub, self.ipc_peers, self.slots_key, self.seats = hub, dict(ipc_peers or {}), slots_key, seats
        self.timeout_s = group.timeout_s if group is not None else timeout_s
        self.digest_algo: DigestAlgo = digest_algo or self.device.digest_algo
        self.ack_timeout_s = ack_timeout_s if ack_timeout_s is not None else 2 * self.timeout_s
        self.wire_hook = wire_hook
        self.digested = digested
        self.on_stage = on_stage  # called with (version, "transferring" | "verifying") from the send thread
        self._slots: list[torch.Tensor] = []
        self._layout_sent = LayoutSent()  # what this sender's receivers hold
        self._stream: Any | None = None  # the send thread's own device stream (made on first use)
        self._busy = threading.Lock()
        # Per-tensor digests of recently sent versions: the bases of sparse versions (shared across senders).
        self.manifests: dict[int, Manifest] = manifests if manifests is not None else {}

    def forget_layouts(self) -> None:
        """Its receivers may have been sent other layouts by another sender since (the next header is whole)."""
        self._layout_sent.forget()

    def send_cached(self, cache: VersionCache, version: int, *, as_version: int | None = None,
                    expected_digest: str | None = None, inline: bool = False,
                    filling: CachedVersion | None = None) -> Transfer:
        """Send a version held in ``cache``, labelled ``as_version`` on the wire when given (e.g. a rollback).
        The cached bytes are checked against what was sent the first time and, given ``expected_digest``,
        against the digest the daemon recorded. The cache keeps its buffer alive until the transfer ends.
        ``filling``: the version while its snapshot still runs (begun in the cache, leased by the caller);
        each bucket goes out once it is filled."""
        hold = contextlib.ExitStack()
        cached = filling if filling is not None else self._lease(hold, cache, version,
                                                                 as_version if as_version is not None else version)
        drop = lambda: evict_quietly(cache, version)  # noqa: E731
        source = CacheSource(cached, self.device, as_version, cache.shared_segment(cached), expected_digest, drop,
                             fill_timeout_s=self.timeout_s)
        transfer = Transfer(source.version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold, inline)

    def send_sparse(self, cache: VersionCache, version: int, base_version: int, *, bucket_size: int,
                    alignment: int, inline: bool = False) -> Transfer:
        """Send a cached version as the changes against ``base_version``, a version this sender sent and the
        receivers hold. It goes out whole when that base is unknown or has another layout."""
        hold = contextlib.ExitStack()
        cached = self._lease(hold, cache, version, version)
        parent = self.manifests.get(cached.parent) if cached.parent is not None else None
        source = SparseCacheSource(cached, self.manifests.get(base_version), bucket_size, alignment,
                                    self.device.comm_device.type == "cpu", parent)
        transfer = Transfer(version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold, inline)

    def send_changes(self, source: PiecesChangesSource, *, inline: bool = False) -> Transfer:
        """Send a class's pieces as the changes against what its receivers hold (send/class_senders.py)."""
        transfer = Transfer(source.version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, contextlib.ExitStack(), inline)

    def send_live(self, version: int, layout: Layout, tensors: TensorsOrProvider, *,
                  aliases: Mapping[str, str] | None = None, step: int | None = None, check: bool = True,
                  owners: Owners | None = None, inline: bool = False, keep: KeepFor | None = None) -> Transfer:
        """Send live tensors without a host copy. They are read until ``params_released`` is set. With
        ``owners``, only this rank's buckets are read, and ``tensors`` is asked for those alone, in order.
        ``check=False`` skips re-checking the tensors against the layout, for callers that planned it from them.
        ``keep``: what of the buckets this rank sends is also kept, and where (its pullers read it there: a
        pulled bypass_cpu version's share, a pulled class's column pieces; send/transfer.py ``Kept``)."""
        if check and not callable(tensors):
            check_matches_layout(layout, tensors)
        transfer = Transfer(version, "bypass_cpu")
        source = LiveSource(version, layout, tensors, aliases or {}, step, transfer.params_released, owners)
        source.keep = keep
        return self._start(source, transfer, contextlib.ExitStack(), inline)

    def _lease(self, hold: contextlib.ExitStack, cache: VersionCache, version: int, label: int) -> CachedVersion:
        """Lease ``version`` from the cache for the transfer's lifetime. When this rank does not hold it, the
        other owners hear so in the votes they wait in, and the lead tells the receivers."""
        try:
            return hold.enter_context(cache.lease(version))
        except CkptEngineError as exc:
            if self.owners_group is not None:
                self.abort_before_start(label, f"owner rank {self.rank} cannot send version {version}: {exc}")
            raise

    def abort_before_start(self, version: int, reason: str) -> None:
        """Tell receivers waiting for ``version`` that it will not come (e.g. the snapshot failed), so they
        stop waiting now instead of at their timeout. Only valid while no version is on the wire. With several
        owners every owner must call it or send the version: they vote first, and the lead aborts for all."""
        with self._busy:
            self.votes.stand_down(version, reason)  # the lead still tells the receivers below
            if not self.lead:
                return
            raw = encode(AbortMessage(version=version, reason=reason))
            for outlet in self._outlets():
                outlet.abort(version, 0, raw)
                outlet.release()

    def close(self) -> None:
        """Tell receivers on the sync group that it is closing, then release it (the IPC hub stays)."""
        with self._busy:
            if self.group is not None and self.channel is not None:
                if self.group.broken is None:
                    try:
                        self.group.ring()
                        self.channel.frame(Frame(FrameKind.CLOSE), 0, "close")
                    except CkptEngineError as exc:
                        log.warning("could not announce close: %s", exc)
                self.group.close()

    def _start(self, source: Source, transfer: Transfer, hold: contextlib.ExitStack, inline: bool = False) -> Transfer:
        """Run the transfer on a thread of its own, or with ``inline`` on the caller's, which is already a
        thread of its own (e.g. the publisher's background send). ``hold`` (e.g. a cache lease) is released when
        the transfer ends."""
        if not self._busy.acquire(blocking=False):
            hold.close()
            raise CkptEngineError(f"version {source.version}: another version is still being sent")
        origin = current_stream(self.device)  # where the caller queued the work that produced its tensors

        def run() -> None:
            try:
                set_current(self.device)  # the current device is per thread on CUDA/NPU
                if self._stream is None:
                    self._stream = new_stream(self.device)
                # Not the caller's stream: the copies, digests and collective waits of a background transfer
                # would otherwise queue behind the training loop's kernels and hold them up in turn.
                with on_stream(self.device, self._stream, after=origin):
                    transfer._finish(self._run(source))
            finally:
                hold.close()
                self._busy.release()

        if inline:
            run()
        else:
            threading.Thread(target=run, name=f"ckpt-send-v{source.version}", daemon=True).start()
        return transfer

    def _outlets(self, source: Source | None = None) -> list[Outlet]:
        outlets: list[Outlet] = []
        if self.channel is not None:
            outlets.append(CollectiveOutlet(self.channel, self._layout_sent, self.seats))
        if self.ipc_peers and self.hub is not None:
            peers, missing = self.hub.peers(self.ipc_peers, self.timeout_s)
            in_place = source.segment if isinstance(source, CacheSource) else None
            outlets.append(IpcOutlet(self.hub, peers, missing, self.timeout_s, self._layout_sent, in_place=in_place,
                                     slots_key=self.slots_key))
        return outlets

    def _run(self, source: Source) -> TransferResult:
        timer = _Timer()
        result = TransferResult(source.version, source.mode, False, None, None, [], 0, 0, 0)
        outlets: list[Outlet] = []
        voted = [False]  # this rank has cast its after-sending vote (several owners: one per version)
        # Only pullers, and a layout known alone: this owner digests and keeps its buckets before the ready vote,
        # which crosses links the pulls fill (its pullers check and read them as soon as it posts them).
        pulled_first = (self.owners_group is not None and self.group is None and not self.ipc_peers
                        and source.plans_alone)
        try:
            if not pulled_first:
                with timer.stage("digest"):
                    source.plan(self.votes.ready(source, self.digest_algo, self.device.comm_device))
            layout, owners = source.layout, source.owners
            mine = owners.buckets_of(self.rank)
            result.buckets, result.tensors = len(layout.buckets), layout.num_tensors
            result.tensors_skipped, result.base_version = source.skipped, source.base_version
            result.bytes_skipped = source.skipped_bytes
            slots = self._ensure_slots(layout, source)
            outlets = self._outlets(source)
            if self.lead:
                with timer.stage("header"):
                    full, slim = self._headers(source)
                    proto = PROTO_CHUNKED if layout.chunked else PROTO_VERSION
                    for outlet in outlets:
                        outlet.begin(source.version, layout.digest, full, slim, proto)
            self._stage(source.version, "transferring")
            kept = source.keep(layout, owners) if source.keep is not None else None
            own = self._send_buckets(source, outlets, slots, timer, result, mine, kept)
            if self.digested is not None:  # (its pullers may check bytes and read what it kept: not load)
                self.digested(source.version, self.slots_key, layout.digest, own, False)
            if pulled_first:
                with timer.stage("control"):
                    source.plan(self.votes.ready(source, self.digest_algo, self.device.comm_device))
            if self.owners_group is not None:
                voted[0] = True  # whatever the vote's outcome, this rank took part in it
            with timer.stage("control"):
                digests = self.votes.sent(source, own)
            if self.digested is not None:  # (after the vote: see __init__)
                self.digested(source.version, self.slots_key, layout.digest, own, True)
            result.version_bytes = layout.total_bytes  # every owner sent its buckets: the version's bytes went out
            self._stage(source.version, "verifying")
            manifest = source.manifest(source.version, self.digest_algo, digests)
            result.version_digest = manifest.version_digest  # of the whole model, also for sparse versions
            if self.lead:
                wire_digest = version_digest(self.digest_algo, layout.digest, digests)
                result.wire_plan = WirePlan(layout, owners, dict(source.aliases), source.step,
                                            dict(source.header_extra))
                trailer = encode(VersionTrailer(version=source.version, version_digest=wire_digest))
                with timer.stage("control"):
                    for outlet in outlets:
                        outlet.end(source.version, trailer)
                with timer.stage("ack"):
                    self._collect_acks(source.version, manifest.version_digest, outlets, result)
                result.absent_ranks += [rank for outlet in outlets if isinstance(outlet, IpcOutlet)
                                        for rank in outlet.absent()]
            else:
                result.ok = True  # this owner's part; what the receivers made of it is the lead's to report
            self._remember(manifest)
            record_identity(source, manifest)
        except CkptEngineError as exc:  # includes Aborted: receivers were told
            result.reason = str(exc)
            if isinstance(exc, ReceiversAbsent):  # its group never carried a frame (see CollectiveOutlet.begin)
                result.rendezvous_failed = True
        except Exception as exc:  # a bug must still end the transfer with a reason, never leave it pending
            log.exception("version %d: unexpected error while sending", source.version)
            result.reason = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            # Release the source before the votes: under bypass_cpu the training loop waits on the live tensors,
            # and it must join the trainer's gathers before its own process-group timeout.
            source.all_filled()
            if not result.ok:  # a receiver may have dropped the version's header: the next one sends the layout
                self._layout_sent.forget()
            if not voted[0] and self.owners_group is not None:  # the other owners wait for this rank's vote
                self.votes.failed(source.version, result.reason or "failed")
            for outlet in outlets:
                outlet.release()
        result.seconds = timer.finish()
        result.finished_at = time.perf_counter()
        log.info("version %d %s: %s in %.3fs (%d bytes, %d buckets)", source.version, source.mode,
                 "committed" if result.ok else f"failed ({result.reason})", result.seconds["total"],
                 result.bytes_sent, result.buckets)
        return result

    def _abort_receivers(self, source: Source, reason: str) -> None:
        """The lead tells the receivers that the version will not complete, and why (best effort)."""
        source.all_filled()  # nothing more is read from the source: release it before any wait
        if not self.lead:
            return
        raw = encode(AbortMessage(version=source.version, reason=reason))
        for outlet in self._outlets(source):
            try:
                outlet.abort(source.version, 0, raw)
            except CkptEngineError as exc:
                log.warning("version %d: could not tell the receivers it was aborted (%s): %s", source.version,
                            reason, exc)

    def _stage(self, version: int, stage: str) -> None:
        if self.on_stage is not None:
            try:
                self.on_stage(version, stage)
            except Exception:  # a progress observer must never break a transfer
                log.exception("on_stage callback failed")

    def _headers(self, source: Source) -> tuple[Callable[[], bytes], bytes]:
        """A function that builds the version header with the layout, and the header without it (for receivers
        that hold the layout). The full one is built only if some receiver needs it: at 20k tensors it costs
        ~70 ms."""
        layout, owners = source.layout, source.owners
        several = {"owner_ranks": owners.ranks, "owners": list(owners.of)} if owners.ranks > 1 else {}
        fields = dict(version=source.version, mode=source.mode, digest_algo=self.digest_algo,
                      layout_digest=layout.digest, step=source.step, aliases=dict(source.aliases),
                      created_at=time.time(), **source.header_extra, **several)
        built: list[bytes] = []

        def full() -> bytes:
            if not built:
                built.append(encode(VersionHeader(layout=LayoutMessage.of(layout), **fields)))
            return built[0]

        return full, encode(VersionHeader(**fields))

    def _send_buckets(self, source: Source, outlets: list[Outlet], slots: list[torch.Tensor], timer: _Timer,
                      result: TransferResult, mine: tuple[int, ...], kept: Kept | None) -> list[int]:
        """Send the buckets ``mine`` (indices in the version's layout, in order), keeping what ``kept`` says.
        Returns their digests, in order."""
        layout = source.layout
        digests: list[int] = []
        if not mine:  # this owner has no bucket of the version: its source is not read at all
            source.all_filled()
        for position, k in enumerate(mine):
            bucket = layout.buckets[k]
            slot_index = position % 2
            with timer.stage("broadcast"):
                for outlet in outlets:
                    outlet.reclaim(slot_index, k)
            try:
                with timer.stage("fill"):
                    buf = source.bucket(k, slots[slot_index] if slots else None)
                with timer.stage("digest"):
                    values = bucket_digests(bucket, buf, self.digest_algo, layout.digest).cpu()
                if kept is not None:  # (the very bytes digested: pullers verify what they read against them)
                    kept.copy(k, buf)
                if self.wire_hook is not None:
                    buf = self.wire_hook(k, buf)
            except Exception as exc:  # noqa: BLE001 - anything that stops preparing a bucket aborts the version for all
                source.all_filled()  # nothing more is read: the training loop goes on while receivers are told
                self._abort(source.version, outlets, len(bucket.slots), f"bucket {k} could not be prepared: {exc}")
            if position == len(mine) - 1:
                source.all_filled()
            with timer.stage("control"):
                for outlet in outlets:
                    outlet.bucket(k, bucket, buf, values, slot_index)
            digests.extend(values.tolist())
            result.bytes_sent += bucket.nbytes
        with timer.stage("broadcast"):
            for outlet in outlets:
                outlet.flush()
        return digests

    def _abort(self, version: int, outlets: list[Outlet], extra_len: int, reason: str) -> None:
        """Tell receivers at the position they expect a frame that this version is abandoned, then stop."""
        raw = encode(AbortMessage(version=version, reason=reason))
        for outlet in outlets:
            outlet.abort(version, extra_len, raw)
        raise Aborted(reason)

    def _collect_acks(self, version: int, digest: str, outlets: list[Outlet], result: TransferResult) -> None:
        own = Ack(version=version, rank=0, ok=True, version_digest=digest)
        problems = []
        for outlet in outlets:
            for ack in outlet.acks(version, own, self.ack_timeout_s):
                if ack.ok and ack.version_digest != digest:
                    ack = ack.model_copy(update={"ok": False, "reason": f"digest {ack.version_digest} != {digest}"})
                result.receivers.append(ack)
                if not ack.ok:
                    problems.append(f"rank {ack.rank}: {ack.reason}")
        result.ok = not problems
        result.reason = "; ".join(problems) or None

    def _remember(self, manifest: Manifest) -> None:
        self.manifests[manifest.version] = manifest
        for old in sorted(self.manifests)[:-_MANIFESTS_KEPT]:
            del self.manifests[old]

    def _ensure_slots(self, layout: Layout, source: Source) -> list[torch.Tensor]:
        need = max(layout.max_bucket_bytes, 1)
        if self.hub is not None and self.ipc_peers:
            # Fills land straight in the shared slots that colocated receivers read, unless the version sits in
            # a shareable cache buffer they read in place.
            shared = self.hub.ensure_slots(need, self.slots_key)
            return [] if isinstance(source, CacheSource) and source.segment is not None else shared
        if not source.needs_slot:
            return []
        if not self._slots or self._slots[0].numel() < need:
            for slot in self._slots:
                forget_fill_views(slot)
            self._slots = [comm_empty(need, self.device) for _ in range(2)]
        return self._slots


class _Timer:
    def __init__(self) -> None:
        self._start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def finish(self) -> dict[str, float]:
        self.seconds["total"] = time.perf_counter() - self._start
        return self.seconds


__all__ = ["Aborted", "NotReady", "Sender", "StaleCopy", "Transfer", "TransferResult", "WireHook", "check_identity"]
