"""The sending side of a version: fills buckets (from the cache or straight from live tensors), digests them,
and broadcasts them double-buffered, so bucket k+1 is being filled while bucket k is on the wire.

A transfer runs on a background thread. ``Transfer.params_released`` is set as soon as the source tensors
are no longer read: right away for a cached version (the cache holds the bytes), after the last bucket has
been filled for a live (``bypass_cpu``) version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ckpt_engine.device import DeviceInfo, DigestAlgo, comm_empty, current_stream, new_stream, on_stream, set_current
from ckpt_engine.errors import CkptEngineError, ConfigError, ProtocolError, SyncTimeoutError
from ckpt_engine.plan.hashing import bucket_digests, layout_digests, version_digest
from ckpt_engine.plan.layout import Layout
from ckpt_engine.plan.modes import Mode
from ckpt_engine.plan.sparse import Manifest, SparsePlan, manifest_of, plan_sparse
from ckpt_engine.plan.tensors import BucketTensors, TensorsOrProvider, check_matches_layout, fill_bucket, provider_of
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.outlets import CollectiveOutlet, IpcOutlet, Outlet
from ckpt_engine.transport.framing import Channel, Frame, FrameKind
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.messages import AbortMessage, Ack, LayoutMessage, VersionHeader, VersionTrailer, encode
from ckpt_engine.transport.same_host import IpcHub

log = logging.getLogger(__name__)
_MANIFESTS_KEPT = 8

# Called with (bucket index, bucket bytes) after the digests are taken; returns the bytes to put on the wire.
# Fault injection for tests and chaos runs: the source (cache or live tensors) is never modified by it.
WireHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class TransferResult:
    version: int
    mode: Mode
    ok: bool
    reason: str | None
    version_digest: str | None
    receivers: list[Ack]
    bytes_sent: int
    buckets: int
    tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    finished_at: float = 0.0  # time.perf_counter() when every acknowledgement was in (or the transfer failed)
    tensors_skipped: int = 0  # sparse: unchanged tensors not sent
    bytes_skipped: int = 0  # sparse: their bytes
    base_version: int | None = None  # sparse: the version the receivers held
    absent_ranks: list[int] = field(default_factory=list)  # receivers that never joined the rendezvous

    @property
    def committed_ranks(self) -> list[int]:
        return [ack.rank for ack in self.receivers if ack.ok]


class Transfer:
    """Handle of one version being sent."""

    def __init__(self, version: int, mode: Mode) -> None:
        self.version = version
        self.mode = mode
        self.gathered_bytes = 0  # bytes of full tensors this rank assembled for it (gathers of a sharded model)
        self.params_released = threading.Event()
        self._done = threading.Event()
        self._result: TransferResult | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> TransferResult:
        if not self._done.wait(timeout_s):
            raise SyncTimeoutError(f"version {self.version} still in transfer after {timeout_s}s")
        if self._result is None:
            raise CkptEngineError(f"version {self.version}: transfer ended without a result")
        return self._result

    def _finish(self, result: TransferResult) -> None:
        self._result = result
        self.params_released.set()
        self._done.set()


class _Source(Protocol):
    """Where a version's bucket bytes come from: live tensors, the cache, or the cache's changes (sparse)."""

    mode: Mode
    layout: Layout  # what goes on the wire (after prepare)
    version: int
    step: int | None
    aliases: Mapping[str, str]
    header_extra: dict
    skipped: int
    skipped_bytes: int
    base_version: int | None
    needs_slot: bool  # bucket() must be given a send slot to fill (else it returns views of the source)

    def prepare(self, algo: DigestAlgo, device: torch.device) -> None: ...

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest: ...

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor: ...

    def all_filled(self) -> None: ...


class _Full:
    """What every full source shares: nothing to prepare, the wire digest is the version digest."""

    header_extra: dict = {}
    skipped = 0
    skipped_bytes = 0
    base_version: int | None = None

    def prepare(self, algo: DigestAlgo, device: torch.device) -> None:
        pass

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        return manifest_of(version, algo, self.layout, wire_digests)  # type: ignore[attr-defined]


class _LiveSource(_Full):
    """bypass_cpu: bucket bytes come straight from the live tensors into the send slot."""

    mode: Mode = "bypass_cpu"
    needs_slot = True

    def __init__(self, version: int, layout: Layout, tensors: TensorsOrProvider,
                 aliases: Mapping[str, str], step: int | None, released: threading.Event) -> None:
        self.version, self.layout, self.aliases, self.step = version, layout, aliases, step
        self._provide: BucketTensors | None = provider_of(tensors)
        self._released = released

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        if slot is None or self._provide is None:
            raise ValueError("a live source needs a send slot and its tensors")
        fill_bucket(slot, bucket.slots, self._provide(bucket), bucket.nbytes)
        return slot[: bucket.nbytes]

    def all_filled(self) -> None:
        self._provide = None  # drop references to the live tensors
        self._released.set()


class _CacheSource(_Full):
    """cached: bucket bytes are read from the version cache (copied to the device when the wire needs it;
    assembled from its own and its parent's bytes for a delta version)."""

    mode: Mode = "cached"

    def __init__(self, cached: CachedVersion, on_host_wire: bool, as_version: int | None = None,
                 segment=None) -> None:
        self.cached = cached
        # gloo sends host memory: a whole cached version goes on the wire without any copy
        self.needs_slot = not (on_host_wire and cached.is_whole)
        # the cache buffer's shareable segment: colocated receivers read it in place
        self.segment = segment if not self.needs_slot else None
        self.layout, self.aliases, self.step = cached.layout, cached.aliases, cached.step
        self.version = cached.version if as_version is None else as_version

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        if not self.cached.is_whole:
            return self.cached.fill(index, _need(slot))
        return _placed(self.cached.bucket(index), _need(slot) if self.needs_slot else slot)

    def all_filled(self) -> None:
        pass


class _SparseCacheSource:
    """cached and sparse: only tensors whose digest differs from the base version's are sent, laid out in
    their own buckets; the header tells receivers the base and the whole model's digest."""

    mode: Mode = "cached"

    def __init__(self, cached: CachedVersion, base: Manifest | None, bucket_size: int, alignment: int,
                 on_host_wire: bool, parent: Manifest | None = None) -> None:
        """``parent``: the manifest of the version a delta ``cached`` shares its unchanged tensors with, when
        known; then only the delta's own tensors are digested."""
        self.cached, self.base, self.parent = cached, base, parent
        self.version, self.aliases, self.step = cached.version, cached.aliases, cached.step
        self.layout = cached.layout
        self.bucket_size, self.alignment = bucket_size, alignment
        self.full: Manifest | None = None
        self.plan: SparsePlan | None = None
        self._on_host_wire = on_host_wire
        self._own_wire = False  # the changes are exactly the delta's own buffer, already in wire layout

    @property
    def needs_slot(self) -> bool:
        in_place = self._own_wire if self.plan is not None else self.cached.is_whole
        return not (self._on_host_wire and in_place)

    @property
    def skipped(self) -> int:
        return self.plan.skipped if self.plan else 0

    @property
    def skipped_bytes(self) -> int:
        return self.plan.skipped_bytes if self.plan else 0

    @property
    def base_version(self) -> int | None:
        return self.base.version if self.plan and self.base else None

    @property
    def header_extra(self) -> dict:
        if self.plan is None or self.full is None:
            return {}
        return {"base_version": self.base_version, "full_layout_digest": self.full.layout_digest,
                "full_version_digest": self.full.version_digest, "skipped": self.plan.skipped}

    def prepare(self, algo: DigestAlgo, device: torch.device) -> None:
        """Digest the cached version (only a delta's own tensors when its parent's digests are known), then
        plan what changed against the base."""
        cached, parent = self.cached, self.parent
        if (not cached.is_whole and parent is not None and parent.algo == algo
                and parent.layout_digest == cached.layout.digest):
            # Per-tensor digests do not depend on the layout, so the delta's own buckets give the changed ones.
            own = cached.own_layout
            changed = dict(zip(cached.changed, layout_digests(own, lambda b: cached.buffer[b.flat_offset:], algo,
                                                              device)))
            self.full = parent.updated(self.version, changed)
        else:
            scratch = None if cached.is_whole else torch.empty(cached.layout.max_bucket_bytes, dtype=torch.uint8)
            read = cached.bucket if cached.is_whole else (lambda b: cached.fill(b, scratch))  # type: ignore[arg-type]
            digests = layout_digests(cached.layout, lambda b: read(b.index), algo, device)
            self.full = manifest_of(self.version, algo, cached.layout, digests)
        self.plan = plan_sparse(cached.layout, self.full, self.base, bucket_size=self.bucket_size,
                                alignment=self.alignment)
        if self.plan is not None:
            self.layout = self.plan.layout
            self._own_wire = not cached.is_whole and self.plan.layout.digest == cached.own_layout.digest

    def manifest(self, version: int, algo: str, wire_digests: list[int]) -> Manifest:
        if self.plan is None or self.full is None:
            return manifest_of(version, algo, self.layout, wire_digests)
        return self.full

    def bucket(self, index: int, slot: torch.Tensor | None) -> torch.Tensor:
        bucket = self.layout.buckets[index]
        if self.plan is None and not self.cached.is_whole:  # no usable base: the full version
            return self.cached.fill(index, _need(slot))
        if self.plan is None or self._own_wire:  # bytes already in wire layout in one cache buffer
            return _placed(self.cached.buffer[bucket.flat_offset : bucket.flat_offset + bucket.nbytes], slot)
        fill_bucket(_need(slot), bucket.slots, self.cached.views(), bucket.nbytes)
        return slot[: bucket.nbytes]  # type: ignore[index]

    def all_filled(self) -> None:
        pass


def _need(slot: torch.Tensor | None) -> torch.Tensor:
    if slot is None:
        raise ValueError("this source needs a send slot")
    return slot


def _placed(view: torch.Tensor, slot: torch.Tensor | None) -> torch.Tensor:
    """``view`` itself, or its bytes copied into ``slot`` when the wire reads from a send slot."""
    if slot is None:
        return view
    slot[: view.numel()].copy_(view, non_blocking=True)
    return slot[: view.numel()]


class Sender:
    """Sends versions as the source (rank 0) of a sync group, to colocated receivers through an IPC hub, or
    both in the same version. ``ipc_peers`` maps the colocated receivers' agent ids to their ranks."""

    def __init__(self, group: SyncGroup | None, *, device: DeviceInfo | None = None, hub: IpcHub | None = None,
                 ipc_peers: Mapping[str, int] | None = None, digest_algo: DigestAlgo | None = None,
                 ack_timeout_s: float | None = None, wire_hook: WireHook | None = None,
                 on_stage: Callable[[int, str], None] | None = None, timeout_s: float = 60.0,
                 manifests: dict[int, Manifest] | None = None) -> None:
        if group is None and not ipc_peers:
            raise ConfigError("a sender needs a sync group, colocated receivers, or both")
        if ipc_peers and hub is None:
            raise ConfigError("colocated receivers need an IPC hub")
        self.group = group
        self.channel = Channel(group) if group is not None else None
        if self.channel is not None and not self.channel.is_src:
            raise ProtocolError(f"rank {group.rank} cannot send: the sender is rank {self.channel.src}")  # type: ignore[union-attr]
        self.device: DeviceInfo = group.device if group is not None else device  # type: ignore[assignment]
        if self.device is None:
            raise ConfigError("a sender without a sync group needs a device")
        self.hub, self.ipc_peers = hub, dict(ipc_peers or {})
        self.timeout_s = group.timeout_s if group is not None else timeout_s
        self.digest_algo: DigestAlgo = digest_algo or self.device.digest_algo
        self.ack_timeout_s = ack_timeout_s if ack_timeout_s is not None else 2 * self.timeout_s
        self.wire_hook = wire_hook
        self.on_stage = on_stage  # called with (version, "transferring" | "verifying") from the send thread
        self._slots: list[torch.Tensor] = []
        self._stream: Any | None = None  # the send thread's own device stream (made on first use)
        self._busy = threading.Lock()
        # Per-tensor digests of recently sent versions: the bases of sparse versions (shared across senders).
        self.manifests: dict[int, Manifest] = manifests if manifests is not None else {}

    def send_cached(self, cache: VersionCache, version: int, *, as_version: int | None = None) -> Transfer:
        """Send a version held in ``cache`` (labelled ``as_version`` on the wire when given, e.g. a rollback);
        the cache keeps its buffer alive until the transfer ends."""
        hold = contextlib.ExitStack()
        cached = hold.enter_context(cache.lease(version))
        source = _CacheSource(cached, self.device.comm_device.type == "cpu", as_version, cache.shared_segment(cached))
        transfer = Transfer(source.version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold)

    def send_sparse(self, cache: VersionCache, version: int, base_version: int, *, bucket_size: int,
                    alignment: int) -> Transfer:
        """Send a cached version as the changes against ``base_version`` (a version this sender sent and the
        receivers hold); a full version when that base is unknown or has another layout."""
        hold = contextlib.ExitStack()
        cached = hold.enter_context(cache.lease(version))
        parent = self.manifests.get(cached.parent) if cached.parent is not None else None
        source = _SparseCacheSource(cached, self.manifests.get(base_version), bucket_size, alignment,
                                    self.device.comm_device.type == "cpu", parent)
        transfer = Transfer(version, "cached")
        transfer.params_released.set()
        return self._start(source, transfer, hold)

    def send_live(self, version: int, layout: Layout, tensors: TensorsOrProvider, *,
                  aliases: Mapping[str, str] | None = None, step: int | None = None, check: bool = True) -> Transfer:
        """Send live tensors without a host copy; read them until ``params_released`` is set.
        ``check=False`` skips re-checking tensors against the layout (for callers that planned it from them)."""
        if check and not callable(tensors):
            check_matches_layout(layout, tensors)
        transfer = Transfer(version, "bypass_cpu")
        source = _LiveSource(version, layout, tensors, aliases or {}, step, transfer.params_released)
        return self._start(source, transfer, contextlib.ExitStack())

    def abort_before_start(self, version: int, reason: str) -> None:
        """Tell receivers waiting for ``version`` that it will not come (e.g. the snapshot failed), so they
        stop waiting now instead of at their timeout. Only valid while no version is on the wire."""
        with self._busy:
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
                        self.channel.frame(Frame(FrameKind.CLOSE), 0, "close")
                    except CkptEngineError as exc:
                        log.warning("could not announce close: %s", exc)
                self.group.close()

    def _start(self, source: _Source, transfer: Transfer, hold: contextlib.ExitStack) -> Transfer:
        """Run the transfer on a background thread; ``hold`` (e.g. a cache lease) is released when it ends."""
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

        threading.Thread(target=run, name=f"ckpt-send-v{source.version}", daemon=True).start()
        return transfer

    def _outlets(self, source: _Source | None = None) -> list[Outlet]:
        outlets: list[Outlet] = []
        if self.channel is not None:
            outlets.append(CollectiveOutlet(self.channel))
        if self.ipc_peers and self.hub is not None:
            peers, missing = self.hub.peers(self.ipc_peers, self.timeout_s)
            in_place = source.segment if isinstance(source, _CacheSource) else None
            outlets.append(IpcOutlet(self.hub, peers, missing, self.timeout_s, in_place=in_place))
        return outlets

    def _run(self, source: _Source) -> TransferResult:
        timer = _Timer()
        result = TransferResult(source.version, source.mode, False, None, None, [], 0, 0, 0)
        outlets: list[Outlet] = []
        try:
            with timer.stage("digest"):
                source.prepare(self.digest_algo, self.device.comm_device)
            layout = source.layout
            result.buckets, result.tensors = len(layout.buckets), layout.num_tensors
            result.tensors_skipped, result.base_version = source.skipped, source.base_version
            result.bytes_skipped = source.skipped_bytes
            slots = self._ensure_slots(layout, source)
            outlets = self._outlets(source)
            with timer.stage("header"):
                full, slim = self._headers(source)
                for outlet in outlets:
                    outlet.begin(source.version, layout.digest, full, slim)
            self._stage(source.version, "transferring")
            digests = self._send_buckets(source, outlets, slots, timer, result)
            self._stage(source.version, "verifying")
            wire_digest = version_digest(self.digest_algo, layout.digest, digests)
            trailer = encode(VersionTrailer(version=source.version, version_digest=wire_digest))
            with timer.stage("control"):
                for outlet in outlets:
                    outlet.end(source.version, trailer)
            manifest = source.manifest(source.version, self.digest_algo, digests)
            result.version_digest = manifest.version_digest  # of the whole model, also for sparse versions
            with timer.stage("ack"):
                self._collect_acks(source.version, manifest.version_digest, outlets, result)
            self._remember(manifest)
        except CkptEngineError as exc:  # includes _Aborted: receivers were told
            result.reason = str(exc)
        except Exception as exc:  # a bug must still end the transfer with a reason, never leave it pending
            log.exception("version %d: unexpected error while sending", source.version)
            result.reason = f"internal error: {type(exc).__name__}: {exc}"
        finally:
            source.all_filled()
            for outlet in outlets:
                outlet.release()
        result.seconds = timer.finish()
        result.finished_at = time.perf_counter()
        log.info("version %d %s: %s in %.3fs (%d bytes, %d buckets)", source.version, source.mode,
                 "committed" if result.ok else f"failed ({result.reason})", result.seconds["total"],
                 result.bytes_sent, result.buckets)
        return result

    def _stage(self, version: int, stage: str) -> None:
        if self.on_stage is not None:
            try:
                self.on_stage(version, stage)
            except Exception:  # a progress observer must never break a transfer
                log.exception("on_stage callback failed")

    def _headers(self, source: _Source) -> tuple[Callable[[], bytes], bytes]:
        """The version header without the layout (for receivers that hold it), and a function that builds
        the one with the layout only if some receiver needs it (at 20k tensors that costs ~70 ms)."""
        layout = source.layout
        fields = dict(version=source.version, mode=source.mode, digest_algo=self.digest_algo,
                      layout_digest=layout.digest, step=source.step, aliases=dict(source.aliases),
                      created_at=time.time(), **source.header_extra)
        built: list[bytes] = []

        def full() -> bytes:
            if not built:
                built.append(encode(VersionHeader(layout=LayoutMessage.of(layout), **fields)))
            return built[0]

        return full, encode(VersionHeader(**fields))

    def _send_buckets(self, source: _Source, outlets: list[Outlet], slots: list[torch.Tensor], timer: _Timer,
                      result: TransferResult) -> list[int]:
        layout = source.layout
        digests: list[int] = []
        for bucket in layout.buckets:
            k = bucket.index
            slot_index = k % 2
            with timer.stage("broadcast"):
                for outlet in outlets:
                    outlet.reclaim(slot_index, k)
            try:
                with timer.stage("fill"):
                    buf = source.bucket(k, slots[slot_index] if slots else None)
                with timer.stage("digest"):
                    values = bucket_digests(bucket, buf, self.digest_algo, layout.digest).cpu()
                if self.wire_hook is not None:
                    buf = self.wire_hook(k, buf)
            except Exception as exc:  # anything that stops us preparing a bucket aborts the version for all
                self._abort(source.version, outlets, len(bucket.slots), f"bucket {k} could not be prepared: {exc}")
            if k == len(layout.buckets) - 1:
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
        raise _Aborted(reason)

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

    def _ensure_slots(self, layout: Layout, source: _Source) -> list[torch.Tensor]:
        need = max(layout.max_bucket_bytes, 1)
        if self.hub is not None and self.ipc_peers:
            # Colocated receivers read the send slots themselves (fills land in shared memory directly) unless
            # the version sits in a shareable cache buffer they read in place.
            shared = self.hub.ensure_slots(need)
            return [] if isinstance(source, _CacheSource) and source.segment is not None else shared
        if not source.needs_slot:
            return []
        if not self._slots or self._slots[0].numel() < need:
            self._slots = [comm_empty(need, self.device) for _ in range(2)]
        return self._slots


class _Aborted(CkptEngineError):
    pass


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
