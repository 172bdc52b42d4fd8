"""Receiving one version, independent of how its bytes arrive (collective or same-host IPC): the layout
from the header, a reused staging buffer, digest checks per bucket, and ``load`` only for a whole verified
version."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ckpt_engine.device import DeviceInfo, comm_empty
from ckpt_engine.errors import ApplyRefused, CkptEngineError, ProtocolError, StagingUnavailable
from ckpt_engine.plan.hashing import bucket_digests, check_algo, version_digest
from ckpt_engine.plan.layout import Bucket, Layout
from ckpt_engine.plan.modes import Mode
from ckpt_engine.plan.sparse import Manifest, manifest_of
from ckpt_engine.plan.tensors import slot_view
from ckpt_engine.transport.messages import Ack, VersionHeader, VersionTrailer

log = logging.getLogger(__name__)


@dataclass
class VersionPayload:
    """What ``load`` receives: a verified version as named tensor views (aliases included)."""

    version: int
    step: int | None
    mode: Mode
    version_digest: str
    tensors: dict[str, torch.Tensor]
    sparse: bool = False  # only the tensors that changed since the version the receiver holds


LoadFn = Callable[[VersionPayload], None]


@dataclass
class ReceiveResult:
    version: int | None
    ok: bool
    reason: str | None = None
    version_digest: str | None = None
    bad_tensors: list[str] = field(default_factory=list)
    loaded: bool = False
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    torn: bool = False  # load failed part way: the model holds no whole version
    unable: str | None = None  # this receiver cannot take versions like this one now (e.g. memory)

    def ack(self, rank: int) -> Ack:
        return Ack(version=self.version or 0, rank=rank, ok=self.ok, version_digest=self.version_digest,
                   reason=self.reason, bad_tensors=self.bad_tensors, seconds=self.seconds)


class SenderAborted(CkptEngineError):
    """The sender abandoned the version; nothing of it was loaded."""


@dataclass
class Incoming:
    """A version being received."""

    header: VersionHeader
    layout: Layout
    algo: str
    staging: torch.Tensor
    result: ReceiveResult
    started: float = field(default_factory=time.perf_counter)
    seconds: dict[str, float] = field(default_factory=dict)
    digests: list[int] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)

    def bucket_view(self, bucket: Bucket) -> torch.Tensor:
        return self.staging[bucket.flat_offset : bucket.flat_offset + bucket.nbytes]

    def add_seconds(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds


class VersionAssembler:
    def __init__(self, device: DeviceInfo, load: LoadFn, *, verify: bool = True) -> None:
        self.device = device
        self.load = load
        self.verify = verify
        self.committed: VersionPayload | None = None
        self.manifest: Manifest | None = None  # per-tensor digests of the committed version (sparse bases)
        self._layouts: dict[str, Layout] = {}
        self._staging: torch.Tensor | None = None
        self._view_cache: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def begin(self, header: VersionHeader, staging: torch.Tensor | None = None) -> Incoming:
        """``staging``: a buffer that already holds (or will hold) the version in wire layout, e.g. the
        sender's shared cache buffer; by default this receiver's own staging buffer (StagingUnavailable when it
        cannot be allocated)."""
        layout = self._layout(header)
        if staging is not None and staging.numel() < layout.total_bytes:
            raise ProtocolError(f"shared buffer of {staging.numel()} bytes cannot hold {layout.total_bytes}")
        return Incoming(header, layout, check_algo(header.digest_algo),
                        self._staging_for(layout) if staging is None else staging, ReceiveResult(header.version, False))

    def forget(self) -> None:
        """Hold no version any more (its label belongs to a history the daemon no longer uses)."""
        self.committed, self.manifest = None, None

    def check_bucket(self, incoming: Incoming, bucket: Bucket, expected: list[int]) -> None:
        """Recompute the bucket's digests from staging and note every tensor that differs."""
        if len(expected) != len(bucket.slots):
            raise ProtocolError(f"bucket {bucket.index}: {len(expected)} digests for {len(bucket.slots)} tensors")
        if not self.verify:
            incoming.digests.extend(expected)
            return
        t0 = time.perf_counter()
        computed = bucket_digests(bucket, incoming.bucket_view(bucket), incoming.algo,  # type: ignore[arg-type]
                                  incoming.layout.digest).cpu().tolist()
        if computed != expected:  # (compared whole first: the names are looked at only on a mismatch)
            incoming.bad.extend(slot.name for slot, got, want in zip(bucket.slots, computed, expected) if got != want)
        incoming.digests.extend(computed)
        incoming.add_seconds("verify", time.perf_counter() - t0)

    def conclude(self, incoming: Incoming, trailer: VersionTrailer) -> ReceiveResult:
        """Compare the whole version with the trailer and, only if everything matches, call ``load``."""
        header, result = incoming.header, incoming.result
        digest = version_digest(incoming.algo, incoming.layout.digest, incoming.digests)
        result.version_digest, result.bad_tensors = digest, incoming.bad
        if trailer.version != header.version:
            result.reason = f"trailer is for version {trailer.version}, header for {header.version}"
        elif incoming.bad:
            result.reason = (f"digest mismatch in {len(incoming.bad)} tensor(s): {', '.join(incoming.bad[:8])}"
                             f"{' ...' if len(incoming.bad) > 8 else ''}")
        elif digest != trailer.version_digest:
            result.reason = f"version digest {digest} != sender's {trailer.version_digest}"
        else:
            manifest, problem = self._next_manifest(incoming)
            if problem is not None:
                result.reason = problem
            else:
                result.version_digest = manifest.version_digest  # the whole model's, also after a sparse version
                if self._load(incoming, result.version_digest):
                    self.manifest = manifest
        return self.finish(incoming)

    def _next_manifest(self, incoming: Incoming) -> tuple[Manifest, str | None]:
        """The manifest this receiver holds once the version is applied; for a sparse version it must hold
        the base, and the whole-model digest with the changes applied must equal the sender's."""
        header = incoming.header
        received = manifest_of(header.version, incoming.algo, incoming.layout, incoming.digests)
        if header.base_version is None:
            return received, None
        base = self.manifest
        if base is None or base.version != header.base_version or base.layout_digest != header.full_layout_digest:
            held = "nothing" if base is None else f"version {base.version}"
            return received, f"sparse version {header.version} applies to version {header.base_version}; this " \
                             f"receiver holds {held}"
        applied = base.updated(header.version, dict(zip(received.names, received.digests)))
        if applied.version_digest != header.full_version_digest:
            return received, (f"whole-model digest after applying would be {applied.version_digest}, the "
                              f"sender's is {header.full_version_digest}")
        return applied, None

    def finish(self, incoming: Incoming, reason: str | None = None) -> ReceiveResult:
        result = incoming.result
        if reason is not None:
            result.reason = reason
        incoming.seconds["total"] = time.perf_counter() - incoming.started
        result.seconds = incoming.seconds
        if not result.ok:
            log.warning("version %s not loaded: %s", result.version, result.reason)
        return result

    def _load(self, incoming: Incoming, digest: str) -> bool:
        header, result = incoming.header, incoming.result
        sparse = header.base_version is not None
        t0 = time.perf_counter()
        try:
            self.load(VersionPayload(header.version, header.step, header.mode, digest, self._views(incoming),
                                     sparse=sparse))
        except ApplyRefused as exc:  # nothing was changed: the model still holds the previous version
            result.reason = f"load refused: {exc}"
            log.warning("version %d refused by the engine: %s", header.version, exc)
            return False
        except Exception as exc:  # the adapter's failure is reported, never swallowed
            result.reason = f"load failed: {type(exc).__name__}: {exc}"
            result.torn = True
            log.exception("load of version %d failed part way; the model is torn until repaired", header.version)
            self.manifest, self.committed = None, None  # the model may be partly updated: it holds no version
            return False
        finally:
            incoming.seconds["load"] = time.perf_counter() - t0
        result.ok = result.loaded = True
        self.committed = VersionPayload(header.version, header.step, header.mode, digest, {}, sparse=sparse)
        return True

    def _views(self, incoming: Incoming) -> dict[str, torch.Tensor]:
        """Named views into staging; built once per (layout, staging buffer) and reused across versions."""
        layout, staging = incoming.layout, incoming.staging
        key = (layout.digest, staging.data_ptr())
        views = self._view_cache.get(key)  # (aliases of tensors a sparse version leaves out are dropped below)
        if views is None:
            if len(self._view_cache) >= 4:  # staging plus a few shared cache buffers
                self._view_cache.clear()
            views = self._view_cache[key] = {s.name: slot_view(staging, s, layout.buckets[s.bucket].flat_offset)
                                             for s in layout.slots}
        if incoming.header.aliases:
            views = dict(views)
            for alias, canonical in incoming.header.aliases.items():
                if canonical in views:
                    views[alias] = views[canonical]
                elif incoming.header.base_version is None:
                    raise ProtocolError(f"alias {alias!r} points at unknown tensor {canonical!r}")
        return views

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

    def _staging_for(self, layout: Layout) -> torch.Tensor:
        need = max(layout.total_bytes, 1)
        if self._staging is None or self._staging.numel() < need:
            self._staging = None
            self._view_cache.clear()  # views keep the old buffer alive
            try:
                self._staging = comm_empty(need, self.device)
            except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError (or OOM subclasses)
                raise StagingUnavailable(f"cannot allocate {need} bytes of staging for version "
                                         f"layout {layout.digest}: {exc}") from exc
        return self._staging
