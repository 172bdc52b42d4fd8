"""Trainer-side front of the library: the one way a version leaves a trainer rank (:meth:`Publisher.publish`),
for every kind of version: cached (snapshot into the versioned host cache, send in the background),
bypass_cpu (send straight from the live tensors), sparse (cache and send only what changed) and re-push
(send a cached version again under a new id).

The cache outlives sync groups: when receivers come and go the caller gives a new route (sync group and
colocated receivers), and cached versions stay available for re-sending on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ckpt_engine.device import DeviceInfo, DigestAlgo
from ckpt_engine.errors import CkptEngineError, ConfigError
from ckpt_engine.plan.changes import ChangeTracker
from ckpt_engine.plan.layout import DEFAULT_ALIGNMENT, Bucket, Layout, plan_layout
from ckpt_engine.plan.modes import Mode, check_sparse
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import NamedTensors, specs_of
from ckpt_engine.send.cache import VersionCache
from ckpt_engine.send.sender import Sender, Transfer, TransferResult, WireHook
from ckpt_engine.transport.group import SyncGroup
from ckpt_engine.transport.same_host import IpcHub

log = logging.getLogger(__name__)

# All-reduce (MAX) of this rank's change-agreement vector with the other trainer ranks' (sparse versions);
# a single process passes None (its own vector is the answer).
Agree = Callable[[list[int]], list[int]]


def owns_nothing(bucket: Bucket) -> bool:
    """``owns`` of a trainer rank that stores and sends nothing (it only takes part in the gathers)."""
    return False


@dataclass(frozen=True)
class Route:
    """Where a version goes: the sync group (None: only colocated receivers) and the colocated receivers
    (agent id -> rank)."""

    group: SyncGroup | None
    ipc_peers: Mapping[str, int]


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
        """``ipc_hub_name``: serve colocated receivers through shared memory under this name (same_host.py)."""
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

    # ---- the one entry -------------------------------------------------------------------------------
    def publish(self, version: int, named: NamedTensors | None = None, *, mode: Mode = "cached",
                step: int | None = None, sparse: bool = False, sparse_base: int | None = None,
                source_version: int | None = None, agree: Agree | None = None,
                route: Callable[[], Route] | None = None, owns: Callable[[Bucket], bool] | None = None) -> Transfer:
        """Start sending ``version``; the returned transfer's ``params_released`` says when the tensors are no
        longer read (the training loop may go on) and ``result()`` how it ended.

        - ``source_version``: send that cached version again as ``version`` (rollback, catch-up, repair);
        - ``mode="cached"``: snapshot ``named`` into the cache, then send from it in the background; with
          ``sparse``, only tensors changed since the previous cached version are gathered and stored (``agree``
          makes every trainer rank take the same decision); with ``sparse_base``, only tensors changed since
          that version (which every receiver holds) are sent;
        - ``mode="bypass_cpu"``: send straight from ``named``, read until ``params_released``.

        Cached versions return after the snapshot, bypass_cpu ones once every bucket has been read (the rest of
        the send goes on in the background either way). ``route()`` gives where to send (called where the send
        starts: on the caller's thread for bypass_cpu, on the background thread for the others); without it,
        the attached group and receivers are used.
        ``owns(bucket)``: whether this rank stores and sends that bucket; a rank that owns none only takes
        part in the gathers of a sharded model (every trainer rank must call publish for the same versions).
        Whatever fails, the gathers of every bucket are done, so the other trainer ranks never wait in one."""
        check_sparse(mode, sparse or sparse_base is not None)
        if source_version is not None:
            transfer = Transfer(version, "cached")
            transfer.params_released.set()
            return self._in_background(transfer, lambda: self._sender(route).send_cached(
                self.cache, source_version, as_version=version))
        if named is None:
            raise ConfigError(f"version {version}: publish needs the tensors (or a source_version to re-send)")
        layout = self.layout_for(named)
        # a rank that stores nothing can build on any parent; one that stores must still hold it
        can_share = (lambda parent: True) if owns is owns_nothing else self.cache.__contains__
        delta = self._delta(version, named, layout, agree, can_share) if sparse else None
        cursor = GatherCursor(named, delta[1] if delta is not None else layout)
        try:
            if owns is not None and not any(owns(b) for b in cursor.layout.buckets):
                return self._gather_only(version, mode, cursor)
            if mode == "bypass_cpu":  # returns once every bucket has been read from the live tensors
                live = self._sender(route).send_live(version, cursor.layout, cursor.bucket_tensors,
                                                     aliases=named.aliases, step=step, check=False)
                live.params_released.wait()
                live.gathered_bytes = cursor.layout.total_bytes
                return live
            self._snapshot(version, named, cursor, delta, step)
        finally:
            cursor.drain()  # after a failure part way: let the other ranks' gathers through
        transfer = Transfer(version, "cached")
        transfer.params_released.set()
        transfer.gathered_bytes = cursor.layout.total_bytes
        if sparse_base is not None:
            send = lambda: self._sender(route).send_sparse(self.cache, version, sparse_base,
                                                           bucket_size=self.bucket_size, alignment=self.alignment)
        else:
            send = lambda: self._sender(route).send_cached(self.cache, version)
        return self._in_background(transfer, send)

    def abort_before_start(self, version: int, reason: str, route: Callable[[], Route] | None = None) -> None:
        """Tell receivers waiting for ``version`` that it will not come (e.g. its snapshot failed)."""
        self._sender(route).abort_before_start(version, reason)

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
        key = named.layout_key()  # cheap key first (no dtype-name lookups or spec objects)
        if self._layout is None or key != self._layout_key:
            self._layout = plan_layout(specs_of(named.tensors), self.bucket_size, self.alignment)
            self._layout_key = key
            log.info("planned layout %s: %d tensors in %d buckets, %d bytes", self._layout.digest,
                     self._layout.num_tensors, len(self._layout.buckets), self._layout.total_bytes)
        return self._layout

    def forget(self) -> None:
        """Drop every cached version and what is known of sent ones (their ids belong to another history)."""
        for version in self.cache.versions():
            self.cache.evict(version)
        self.manifests.clear()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.hub is not None:
            self.hub.close()

    # ---- internals -----------------------------------------------------------------------------------
    def _delta(self, version: int, named: NamedTensors, layout: Layout, agree: Agree | None,
               can_share: Callable[[int], bool]) -> tuple[int, Layout] | None:
        """(parent version, layout of the tensors changed since it), as every trainer rank agrees, or None for
        a full snapshot; the cache must still hold the parent to share the rest with it."""
        vector = self._changes.vector(version, named, layout, can_share)
        return self._changes.delta(agree(vector) if agree is not None else vector, layout)

    def _snapshot(self, version: int, named: NamedTensors, cursor: GatherCursor,
                  delta: tuple[int, Layout] | None, step: int | None) -> None:
        if delta is not None:  # only what changed is gathered and stored; the rest is shared in the cache
            self.cache.snapshot_delta(version, delta[0], cursor.layout, cursor.bucket_tensors, aliases=named.aliases,
                                      step=step)
        else:
            self.cache.snapshot(version, cursor.layout, cursor.bucket_tensors, aliases=named.aliases, step=step,
                                check=False)

    def _gather_only(self, version: int, mode: Mode, cursor: GatherCursor) -> Transfer:
        """A rank that owns no bucket: its part is the gathers (``cursor.drain``, in the caller's finally)."""
        transfer = Transfer(version, mode)
        transfer.gathered_bytes = cursor.layout.total_bytes
        transfer._finish(TransferResult(version, mode, True, "this rank sends no bucket of it", None, [], 0, 0, 0,
                                        finished_at=time.perf_counter()))
        return transfer

    def _sender(self, route: Callable[[], Route] | None) -> Sender:
        if route is not None:
            where = route()
            self.attach(where.group, where.ipc_peers)
        if self.sender is None:
            raise CkptEngineError("no sync group attached to this publisher yet")
        return self.sender

    @staticmethod
    def _in_background(transfer: Transfer, send: Callable[[], Transfer]) -> Transfer:
        """``send()`` (which may first wait for its route, e.g. a rendezvous) on a thread of its own; its
        transfer's outcome becomes ``transfer``'s."""

        def run() -> None:
            try:
                result = send().result()
            except Exception as exc:  # the route or the start of the send failed: the version ends with why
                log.exception("version %d could not be sent", transfer.version)
                result = TransferResult(transfer.version, transfer.mode, False, f"{type(exc).__name__}: {exc}", None,
                                        [], 0, 0, 0, finished_at=time.perf_counter(),
                                        absent_ranks=list(getattr(exc, "absent_ranks", [])))
            transfer._finish(result)

        threading.Thread(target=run, name=f"ckpt-publish-v{transfer.version}", daemon=True).start()
        return transfer


class GatherCursor:
    """Hands out full tensors bucket by bucket and remembers how far it got, so that after a failure this rank
    can still take part in the remaining gathers the other trainer ranks are waiting in."""

    def __init__(self, named: NamedTensors, layout: Layout) -> None:
        self.named, self.layout = named, layout
        self._next = 0
        self._lock = threading.Lock()

    def bucket_tensors(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        with self._lock:
            if bucket.index != self._next:
                raise CkptEngineError(f"bucket {bucket.index} requested out of order (expected {self._next})")
            self._next += 1
            return self.named.bucket_tensors(bucket)

    def drain(self) -> None:
        with self._lock:
            for bucket in self.layout.buckets[self._next:]:
                self.named.bucket_tensors(bucket)
            self._next = len(self.layout.buckets)


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
