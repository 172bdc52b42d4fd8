"""Receiving one version, whatever carries its bytes (collective or same-host IPC): the layout from the header,
the staging chosen for it (receive/staging.py) and digest checks per bucket. ``load`` only ever gets verified
bytes: a whole version at once (device or host staging), or bucket by bucket into a load that takes a stream
(receive/streamed.py).

A transport drives a version through a ``Feed``: the bytes of each bucket into the buffer it is given, the
digests the sender announced for it, and the trailer.
"""

from __future__ import annotations

import collections
import logging
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ckpt_engine.device import DeviceInfo, synchronize
from ckpt_engine.errors import ApplyRefused, ProtocolError
from ckpt_engine.plan.hashing import bucket_digests, check_algo, version_digest, warm_up
from ckpt_engine.plan.layout import Bucket, Layout, TensorSpec
from ckpt_engine.plan.modes import DEFAULT_STAGING
from ckpt_engine.plan.sparse import Manifest, wire_manifest
from ckpt_engine.plan.tensors import slot_view
from ckpt_engine.receive.buffers import StagingBuffers
from ckpt_engine.receive.payload import LoadFn, ReceiveResult, SenderAborted, StreamFailed, VersionPayload
from ckpt_engine.receive.staging import Held, Staging, StagingChoice, StagingNeeds, choose_staging
from ckpt_engine.transport.messages import VersionHeader, VersionTrailer

log = logging.getLogger(__name__)
__all__ = ["Feed", "Incoming", "LoadFn", "ReceiveResult", "SenderAborted", "VersionAssembler", "VersionPayload"]


class Feed(Protocol):
    # Buckets that may be on the wire at once when each lands in its own place: several owners send theirs at
    # the same time, each on its own group. 1: one at a time.
    parallel: int

    def start(self, bucket: Bucket, into: torch.Tensor) -> Callable[[], list[int]] | None:
        """Begin receiving ``bucket`` into ``into``. Returns a wait that ends when the bytes are there and gives
        the sender's digests of them. None when the bucket will not come because its owner aborted: the version
        fails, but the other owners' buckets still come."""

    def trailer(self) -> VersionTrailer:
        """The version's end (raises SenderAborted, or ProtocolError when a bucket never came)."""

    def follow_the_rest(self, layout: Layout) -> None:
        """After the lead's abort: take the other senders' remaining buckets off the wire (nothing of them is
        used), so they end the version now."""


@dataclass
class Incoming:
    """A version being received."""

    header: VersionHeader
    layout: Layout
    algo: str
    choice: StagingChoice
    result: ReceiveResult
    shared: torch.Tensor | None = None  # the sender's buffer holding the version (same host): nothing staged
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    landing: dict[int, torch.Tensor] = field(default_factory=dict)  # streamed: each bucket's buffer, while used
    on_wire: dict[int, tuple[Callable[[], list[int]] | None, float]] = field(default_factory=dict)  # streamed: started
    next_bucket: int = 0  # streamed: the first bucket not started yet
    assembly: torch.Tensor | None = None  # streamed: the chunked tensor being put together
    digests: list[int] = field(default_factory=list)  # per piece, in wire order
    bad: list[str] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # buckets whose owner aborted

    def add_seconds(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


class VersionAssembler:
    def __init__(self, device: DeviceInfo, load: LoadFn, *, verify: bool = True, staging: Staging = DEFAULT_STAGING,
                 staging_share: float = 0.5, budget: int | None = None, streams: bool = False) -> None:
        """``staging``: the policy (see staging.py); ``staging_share``: the part of free memory it may take;
        ``budget``: bytes to consider free instead of measuring; ``streams``: ``load`` can take a stream."""
        self.device = device
        self.load = load
        self.verify = verify
        self.staging, self.staging_share, self.budget, self.streams = staging, staging_share, budget, streams
        self.committed: VersionPayload | None = None
        self.manifest: Manifest | None = None  # per-tensor digests of the committed version (sparse bases)
        self.buffers = StagingBuffers(device)
        warm_up(device.comm_device)  # compile the device digest before the first version needs it
        self._layouts: dict[str, Layout] = {}
        self._view_cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    # ---- a version's start -------------------------------------------------------------------------------
    def begin(self, header: VersionHeader, staging: torch.Tensor | None = None) -> Incoming:
        """Start receiving the version ``header`` announces. ``staging``: a buffer that already holds (or will
        hold) the version in wire layout, e.g. the sender's shared cache buffer. Without one, staging is chosen
        and allocated here (StagingUnavailable when it cannot be)."""
        layout = self._layout(header)
        if staging is not None and staging.numel() < layout.total_bytes:
            raise ProtocolError(f"shared buffer of {staging.numel()} bytes cannot hold {layout.total_bytes}")
        result = ReceiveResult(header.version, False)
        if staging is not None:
            mode = "stream" if self.streams and self.staging == "stream" else "device"
            how = "streamed into the load as each bucket verifies" if mode == "stream" else "handed over whole"
            choice = StagingChoice(mode, f"same host: read where the sender holds it, nothing staged; {how}")  # type: ignore[arg-type]
        else:
            choice = self._choose(layout)
            before = (_ptr(self.buffers.whole), _ptr(self.buffers.host))
            self.buffers.prepare(choice.mode, layout)
            if (_ptr(self.buffers.whole), _ptr(self.buffers.host)) != before:
                self._view_cache.clear()  # views keep the old buffers alive
        result.staging = "shared" if staging is not None else choice.mode
        result.staging_why = choice.why
        return Incoming(header, layout, check_algo(header.digest_algo), choice, result, shared=staging)

    def _choose(self, layout: Layout) -> StagingChoice:
        if self.staging != "auto":
            return choose_staging(self.staging, StagingNeeds.of(layout), free_device=0, free_host=0, share=1.0,
                                  streams=self.streams)
        if self.budget is not None:  # what staging may take in all, the buffers it holds included
            free_device, free_host, held = self.budget, self.budget, Held()
        else:  # measured: the buffers held here are not free, yet they are this staging's to reuse
            (free_device, free_host), held = self.buffers.free(), self.buffers.held()
        return choose_staging("auto", StagingNeeds.of(layout), free_device=free_device, free_host=free_host,
                              share=self.staging_share, held=held, streams=self.streams)

    def forget(self) -> None:
        """Hold no version any more (its label belongs to a history the daemon no longer uses)."""
        self.committed, self.manifest = None, None

    # ---- the buckets -------------------------------------------------------------------------------------
    def flow(self, incoming: Incoming, feed: Feed) -> Iterator[Bucket]:
        """Every bucket through ``feed`` into its buffer, each checked while the next is on the wire; yields each
        bucket once checked (a bucket whose owner aborted is noted in ``incoming.missing`` and not yielded).
        Host staging copies each checked bucket to its place in host memory."""
        if incoming.choice.mode == "stream" and incoming.shared is None:
            yield from self._streamed_flow(incoming, feed)
            return
        # Buckets that land in a place of their own (a whole buffer) may be on the wire together: with several
        # owners, one of each owner's, so their links run at once instead of taking turns.
        window = max(1, feed.parallel) if incoming.choice.mode == "device" else 1
        on_wire: collections.deque[tuple[Bucket, Callable[[], list[int]] | None, float]] = collections.deque()
        previous: tuple[Bucket, list[int]] | None = None
        for bucket in incoming.layout.buckets:
            on_wire.append((bucket, feed.start(bucket, self.bucket_buffer(incoming, bucket)), time.perf_counter()))
            if previous is not None:
                yield self._checked(incoming, *previous)  # overlaps with this bucket on the wire
                previous = None
            if len(on_wire) >= window:
                previous = self._landed(incoming, *on_wire.popleft())
        while on_wire:
            if previous is not None:
                yield self._checked(incoming, *previous)
            previous = self._landed(incoming, *on_wire.popleft())
        if previous is not None:
            yield self._checked(incoming, *previous)

    def _landed(self, incoming: Incoming, bucket: Bucket, wait: Callable[[], list[int]] | None,
                t0: float) -> tuple[Bucket, list[int]] | None:
        """Wait for a bucket on the wire; its sender's digests (None: its owner aborted, it will not come)."""
        if wait is None:
            incoming.missing.append(bucket.index)
            return None
        expected = wait()
        incoming.add_seconds("recv", time.perf_counter() - t0)
        incoming.result.bytes_received += bucket.nbytes
        return bucket, expected

    def _streamed_flow(self, incoming: Incoming, feed: Feed) -> Iterator[Bucket]:
        """Streamed: bucket k+1 goes on the wire while bucket k is applied. ``start_next`` starts it once the
        load took k's first tensor and so let go of bucket k-1: a load's loop holds its last tensor until it is
        given the next. So two bucket buffers are in use, not three. A bucket not started by then starts here."""
        for bucket in incoming.layout.buckets:
            self.start_next(incoming, feed, upto=bucket.index)
            wait, t0 = incoming.on_wire.pop(bucket.index)
            if wait is None:
                incoming.missing.append(bucket.index)
                incoming.landing.pop(bucket.index, None)
                continue
            expected = wait()
            wait = None  # the wait holds the bucket's buffer: let only the load keep it
            incoming.add_seconds("recv", time.perf_counter() - t0)
            incoming.result.bytes_received += bucket.nbytes
            yield self._checked(incoming, bucket, expected)
            incoming.landing.pop(bucket.index, None)  # the load's views keep the buffer while it needs them

    def start_next(self, incoming: Incoming, feed: Feed, upto: int | None = None) -> None:
        """Streamed: put the next bucket not started yet on the wire (``upto``: only if its index is at most
        that); buckets are started in order, each after the one before it was received."""
        index = incoming.next_bucket
        if incoming.shared is not None:  # the sender's buffer holds it: flow() takes every bucket in order itself
            return
        if index >= len(incoming.layout.buckets) or (upto is not None and index > upto):
            return
        bucket = incoming.layout.buckets[index]
        incoming.landing[index] = self.buffers.landing(bucket.nbytes)
        incoming.on_wire[index] = (feed.start(bucket, incoming.landing[index][: bucket.nbytes]), time.perf_counter())
        incoming.next_bucket = index + 1

    def bucket_buffer(self, incoming: Incoming, bucket: Bucket) -> torch.Tensor:
        landed = incoming.landing.get(bucket.index)
        if landed is not None:
            return landed[: bucket.nbytes]
        return self.buffers.bucket(incoming.layout, bucket, incoming.shared)

    def _checked(self, incoming: Incoming, bucket: Bucket, expected: list[int]) -> Bucket:
        self.check_bucket(incoming, bucket, expected)
        if incoming.choice.mode == "host" and incoming.shared is None and bucket.nbytes:
            host = self.buffers.host
            host[bucket.flat_offset : bucket.flat_offset + bucket.nbytes].copy_(  # type: ignore[index]
                self.bucket_buffer(incoming, bucket), non_blocking=True)
        return bucket

    def check_bucket(self, incoming: Incoming, bucket: Bucket, expected: list[int]) -> None:
        """Recompute the bucket's digests from where it landed and note every tensor that differs."""
        if len(expected) != len(bucket.slots):
            raise ProtocolError(f"bucket {bucket.index}: {len(expected)} digests for {len(bucket.slots)} tensors")
        if not self.verify:
            incoming.digests.extend(expected)
            return
        t0 = time.perf_counter()
        computed = bucket_digests(bucket, self.bucket_buffer(incoming, bucket), incoming.algo,  # type: ignore[arg-type]
                                  incoming.layout.digest).cpu().tolist()
        if computed != expected:  # compared whole first: names are looked at only on a mismatch
            incoming.bad.extend(slot.name for slot, got, want in zip(bucket.slots, computed, expected)
                                if got != want and slot.name not in incoming.bad)
        incoming.digests.extend(computed)
        incoming.add_seconds("verify", time.perf_counter() - t0)

    # ---- a whole version's end ---------------------------------------------------------------------------
    def conclude(self, incoming: Incoming, trailer: VersionTrailer) -> ReceiveResult:
        """Compare the whole version with the trailer and, only if everything matches, call ``load``."""
        result = incoming.result
        manifest, problem = self.judge(incoming, trailer)
        if manifest is None:
            result.reason = problem
        else:
            result.version_digest = manifest.version_digest  # the whole model's, also after a sparse version
            if incoming.choice.mode == "host":
                synchronize(self.device)  # the copies to host memory are asynchronous
            if self._load(incoming, result.version_digest):
                self.manifest = manifest
        return self.finish(incoming)

    def judge(self, incoming: Incoming, trailer: VersionTrailer) -> tuple[Manifest | None, str | None]:
        """The manifest this receiver holds once the version is applied, or why the version is not whole and
        verified (digests, the trailer, the sparse base)."""
        header, result = incoming.header, incoming.result
        digest = version_digest(incoming.algo, incoming.layout.digest, incoming.digests)
        result.version_digest, result.bad_tensors = digest, incoming.bad
        if trailer.version != header.version:
            return None, f"trailer is for version {trailer.version}, header for {header.version}"
        if incoming.bad:
            return None, (f"digest mismatch in {len(incoming.bad)} tensor(s): {', '.join(incoming.bad[:8])}"
                          f"{' ...' if len(incoming.bad) > 8 else ''}")
        if digest != trailer.version_digest or len(incoming.digests) != len(incoming.layout.pieces):
            return None, f"version digest {digest} != sender's {trailer.version_digest}"
        return self.next_manifest(incoming, wire_manifest(header.version, incoming.algo, incoming.layout,
                                                          incoming.digests))

    def next_manifest(self, incoming: Incoming, received: Manifest) -> tuple[Manifest | None, str | None]:
        """For a sparse version this receiver must hold the base, and the whole-model digest with the changes
        applied must equal the sender's."""
        header = incoming.header
        if header.base_version is None:
            return received, None
        problem = self.base_problem(header)
        if problem is not None:
            return None, problem
        applied = self.manifest.updated(header.version, dict(zip(received.names, received.digests)))  # type: ignore[union-attr]
        if applied.version_digest != header.full_version_digest:
            return None, (f"whole-model digest after applying would be {applied.version_digest}, the "
                              f"sender's is {header.full_version_digest}")
        return applied, None

    def base_problem(self, header: VersionHeader) -> str | None:
        """Why this receiver cannot apply a sparse ``header`` (it does not hold its base), or None."""
        base = self.manifest
        if header.base_version is None or (base is not None and base.version == header.base_version
                                           and base.layout_digest == header.full_layout_digest):
            return None
        held = "nothing" if base is None else f"version {base.version}"
        return f"sparse version {header.version} applies to version {header.base_version}; this receiver holds {held}"

    def finish(self, incoming: Incoming, reason: str | None = None) -> ReceiveResult:
        result = incoming.result
        if reason is not None:
            result.reason = reason
        incoming.seconds["total"] = time.perf_counter() - incoming.started
        result.seconds = incoming.seconds
        if not result.ok:
            log.warning("version %s not loaded: %s", result.version, result.reason)
        return result

    def loaded(self, incoming: Incoming, digest: str) -> None:
        """``load`` took the version whole: this receiver holds it."""
        header, result = incoming.header, incoming.result
        result.ok = result.loaded = True
        self.committed = VersionPayload(header.version, header.step, header.mode, digest, {},
                                        sparse=header.base_version is not None)

    def _load(self, incoming: Incoming, digest: str) -> bool:
        header = incoming.header
        payload = VersionPayload(header.version, header.step, header.mode, digest, self._views(incoming),
                                 sparse=header.base_version is not None, specs=self.specs(incoming),
                                 aliases=dict(header.aliases))
        failure = self.call_load(incoming, payload)
        if failure is None:
            self.loaded(incoming, digest)
            return True
        return False

    def call_load(self, incoming: Incoming, payload: VersionPayload, *, touched: Callable[[], bool] = lambda: True
                  ) -> BaseException | None:
        """Hand ``payload`` to ``load``; returns its failure, or None when it took the version. An ApplyRefused
        changed nothing. Any other failure leaves the model torn when ``touched()`` says something of the version
        reached it."""
        result, header = incoming.result, incoming.header
        t0 = time.perf_counter()
        try:
            self.load(payload)
            return None
        except ApplyRefused as exc:  # nothing was changed: the model still holds the previous version
            result.reason = f"load refused: {exc}"
            log.warning("version %d refused by the engine: %s", header.version, exc)
            return exc
        except Exception as exc:  # the adapter's failure is reported, never swallowed
            result.reason = f"load failed: {type(exc).__name__}: {exc}"
            if touched():
                result.torn = True
                # a stream that failed its own checks says all in its message; the adapter's failures keep their stack
                log.error("load of version %d failed part way; the model is torn until repaired: %s: %s",
                          header.version, type(exc).__name__, exc, exc_info=not _caused_by(exc, StreamFailed))
                self.manifest, self.committed = None, None  # the model may be partly updated: it holds no version
            return exc
        finally:
            incoming.seconds["load"] = time.perf_counter() - t0
            incoming.seconds["pause"] = payload.paused_s if payload.paused_s is not None else incoming.seconds["load"]

    def specs(self, incoming: Incoming) -> Mapping[str, TensorSpec]:
        """Every tensor the version carries, aliases included, as known from its header. Without aliases this is
        the layout's own read-only mapping, built once per layout, not per version."""
        if not incoming.header.aliases:
            return incoming.layout.spec_of
        specs: dict[str, TensorSpec] = dict(incoming.layout.spec_of)
        for alias, canonical in incoming.header.aliases.items():
            if canonical in specs:
                specs[alias] = TensorSpec(alias, specs[canonical].dtype, specs[canonical].shape)
            elif incoming.header.base_version is None:
                raise ProtocolError(f"alias {alias!r} points at unknown tensor {canonical!r}")
        return types.MappingProxyType(specs)  # read-only with aliases too: one behaviour for every load

    def _views(self, incoming: Incoming) -> dict[str, torch.Tensor]:
        """Named views into the whole buffer holding the version; built once per (layout, buffer) and reused."""
        layout = incoming.layout
        if not layout.slots:  # a sparse version where nothing changed: no bucket, nothing staged
            return {}
        staging = incoming.shared if incoming.shared is not None else (
            self.buffers.host if incoming.choice.mode == "host" else self.buffers.whole)
        key = (layout.digest, staging.data_ptr())  # type: ignore[union-attr]
        views = self._view_cache.get(key)  # aliases of tensors a sparse version leaves out are dropped below
        if views is None:
            if len(self._view_cache) >= 4:  # staging plus a few shared cache buffers
                self._view_cache.clear()
            views = self._view_cache[key] = {s.name: slot_view(staging, s, layout.buckets[s.bucket].flat_offset)  # type: ignore[arg-type]
                                             for s in layout.slots}
        if incoming.header.aliases:
            views = dict(views)
            for alias, canonical in incoming.header.aliases.items():
                if canonical in views:
                    views[alias] = views[canonical]
                elif incoming.header.base_version is None:
                    raise ProtocolError(f"alias {alias!r} points at unknown tensor {canonical!r}")
        return views

    # ---- layouts -----------------------------------------------------------------------------------------
    def layout_of(self, header: VersionHeader) -> Layout:
        return self._layout(header)

    def _layout(self, header: VersionHeader) -> Layout:
        layout = self._layouts.get(header.layout_digest)
        if layout is not None:
            return layout
        if header.layout is None:
            raise ProtocolError(f"version {header.version} names layout {header.layout_digest}, which this "
                                "receiver was never sent")
        if header.layout.digest != header.layout_digest:
            raise ProtocolError("header's layout_digest differs from its layout's digest")
        layout = header.layout.to_layout()
        self._layouts = {layout.digest: layout}  # keep only the newest: layouts change rarely
        return layout


def _ptr(buffer: torch.Tensor | None) -> int | None:
    return None if buffer is None else buffer.data_ptr()


def _caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` is a ``kind``, or was raised from or while handling one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
