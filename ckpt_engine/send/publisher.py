"""Trainer-side front of the library: plans the layout, snapshots into the version cache (cached mode) or
sends the live tensors (``bypass_cpu``), and keeps re-sendable versions.

The cache outlives sync groups: when receivers come and go the caller attaches a new group, and cached
versions stay available for re-sending on it.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch

from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.plan.changes import ChangeTracker
from ckpt_engine.device import DeviceInfo, DigestAlgo
from ckpt_engine.errors import CkptEngineError, ConfigError
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.same_host import IpcHub
from ckpt_engine.plan.layout import DEFAULT_ALIGNMENT, Layout, plan_layout
from ckpt_engine.send.sender import Sender, Transfer, WireHook
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import NamedTensors, specs_of

log = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        group: SyncGroup | None = None,
        *,
        device: DeviceInfo | None = None,
        bucket_size: int,
        alignment: int = DEFAULT_ALIGNMENT,
        keep_versions: int = 2,
        digest_algo: DigestAlgo | None = None,
        ack_timeout_s: float | None = None,
        wire_hook: WireHook | None = None,
        on_stage: Callable[[int, str], None] | None = None,
        ipc_hub_name: str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        """``ipc_hub_name``: serve colocated receivers through shared memory under this name (see ipc.py)."""
        if bucket_size <= 0:
            raise ConfigError(f"bucket_size must be positive, got {bucket_size}")
        if group is None and device is None:
            raise ConfigError("a Publisher needs a sync group or, until one is attached, a device")
        self.bucket_size = bucket_size
        self.alignment = alignment
        self.device: DeviceInfo = group.device if group is not None else device  # type: ignore[assignment]
        # With colocated receivers the cache lives in shareable memory: cached versions reach them zero-copy.
        self.cache = VersionCache(self.device, keep_versions, shareable=ipc_hub_name is not None)
        self.hub = IpcHub(ipc_hub_name, self.device) if ipc_hub_name else None
        self.manifests: dict[int, Manifest] = {}  # per-tensor digests of recent versions: sparse bases
        self._sender_options = dict(digest_algo=digest_algo, ack_timeout_s=ack_timeout_s, wire_hook=wire_hook,
                                    on_stage=on_stage, timeout_s=timeout_s, manifests=self.manifests)
        self.sender: Sender | None = None
        self._layout: Layout | None = None
        self._layout_key: list[tuple[str, torch.dtype, torch.Size]] = []
        self._changes = ChangeTracker(self.device.digest_algo, bucket_size, alignment)
        if group is not None:
            self.attach(group)

    def attach(self, group: SyncGroup | None, ipc_peers: Mapping[str, int] | None = None) -> None:
        """Send on ``group`` and to the colocated ``ipc_peers`` (agent id -> rank) from now on; the caller
        closes the previous group. Attaching the same receivers again keeps the sender (and what it knows
        its receivers hold, such as the layout)."""
        peers = dict(ipc_peers or {})
        current = self.sender
        if current is not None and current.group is group and current.ipc_peers == peers:
            return
        self.sender = Sender(group, device=self.device, hub=self.hub, ipc_peers=peers,
                             **self._sender_options)  # type: ignore[arg-type]

    def layout_for(self, named: NamedTensors) -> Layout:
        """The layout of these tensors; re-planned only when names, dtypes or shapes changed. Either way the
        tensors match the returned layout, so the cache and sender need not check them again."""
        # Cheap key first (no dtype-name lookups or spec objects): re-plan only when it changes.
        key = named.layout_key()
        if self._layout is None or key != self._layout_key:
            self._layout = plan_layout(specs_of(named.tensors), self.bucket_size, self.alignment)
            self._layout_key = key
            log.info("planned layout %s: %d tensors in %d buckets, %d bytes", self._layout.digest,
                     self._layout.num_tensors, len(self._layout.buckets), self._layout.total_bytes)
        return self._layout

    def snapshot(self, version: int, named: NamedTensors, *, step: int | None = None) -> CachedVersion:
        """Copy the tensors into the cache as ``version`` (the only part of cached mode that holds the trainer)."""
        return self.cache.snapshot(version, self.layout_for(named), named.bucket_tensors, aliases=named.aliases,
                                   step=step, check=False)

    def snapshot_changes(self, version: int, named: NamedTensors, *, step: int | None = None) -> CachedVersion:
        """Like :meth:`snapshot`, but only tensors changed since the previously snapshotted version are copied;
        the cache shares the others with it (a full snapshot when there is nothing to compare with)."""
        layout = self.layout_for(named)
        delta = self._changes.delta(self._changes.vector(version, named, layout, self.cache.__contains__), layout)
        if delta is None:
            return self.snapshot(version, named, step=step)
        return self.cache.snapshot_delta(version, delta[0], delta[1], named.bucket_tensors, aliases=named.aliases,
                                         step=step)

    def publish(self, version: int, named: NamedTensors, *, bypass_cpu: bool = False, step: int | None = None,
                sparse_base: int | None = None) -> Transfer:
        """Start sending ``version``. Cached mode returns after the snapshot (``params_released`` is set);
        bypass_cpu returns at once and reads the tensors until ``params_released`` is set.
        ``sparse_base``: send only what changed since that version (cached mode; see sparse.py)."""
        sender = self._require_sender()
        if sparse_base is not None and not bypass_cpu:
            self.snapshot_changes(version, named, step=step)
            return self.send_sparse(version, sparse_base)
        if bypass_cpu:
            layout = self.layout_for(named)
            return sender.send_live(version, layout, named.bucket_tensors, aliases=named.aliases, step=step,
                                    check=False)
        self.snapshot(version, named, step=step)
        return sender.send_cached(self.cache, version)

    def send_sparse(self, version: int, base_version: int) -> Transfer:
        """Send cached ``version`` as its changes against ``base_version`` (full when that base is unknown)."""
        return self._require_sender().send_sparse(self.cache, version, base_version, bucket_size=self.bucket_size,
                                                  alignment=self.alignment)

    def republish(self, version: int, *, as_version: int | None = None) -> Transfer:
        """Send a cached version again (rollback, or a receiver that missed it), optionally under a new id."""
        return self._require_sender().send_cached(self.cache, version, as_version=as_version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.hub is not None:
            self.hub.close()

    def _require_sender(self) -> Sender:
        if self.sender is None:
            raise CkptEngineError("no sync group attached to this publisher yet")
        return self.sender


def version_digest_of(named: NamedTensors, *, bucket_size: int, alignment: int = DEFAULT_ALIGNMENT,
                      algo: DigestAlgo = "xxh3-64") -> str:
    """The version digest these tensors would be sent with: lets any process check that the weights it
    holds are exactly a version's (e.g. a rollout's model against the history's digest)."""
    from ckpt_engine.plan.hashing import layout_digests, version_digest
    from ckpt_engine.plan.tensors import fill_bucket

    layout = plan_layout(specs_of(named.tensors), bucket_size, alignment)
    scratch = torch.empty(max(layout.max_bucket_bytes, 1), dtype=torch.uint8)

    def read(bucket) -> torch.Tensor:
        fill_bucket(scratch, bucket.slots, {k: v.detach().cpu() for k, v in named.bucket_tensors(bucket).items()},
                    bucket.nbytes)
        return scratch

    return version_digest(algo, layout.digest, layout_digests(layout, read, algo))
