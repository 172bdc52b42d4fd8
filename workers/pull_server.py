"""A trainer rank's side of the ``nixl`` transport: it offers cached versions (or its share of them) for
receivers to pull.

The daemon joins the owner ranks' offers into one and hands it on to the version's pullers. Each offered
version stays leased (its buffer is not reused) until the daemon moves on to a newer version or the version's
time is up, whichever comes first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from ckpt_engine.control.messages import Assignment, RegisterReply
from ckpt_engine.device import DigestAlgo
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.send.cache import CachedVersion, VersionCache
from ckpt_engine.send.class_senders import PulledClass
from ckpt_engine.send.publisher import Publisher
from ckpt_engine.send.pull_offer import offer_cached, offer_classes, offer_share
from ckpt_engine.send.transfer import TransferResult, WirePlan
from ckpt_engine.transport.messages import PullOffer
from ckpt_engine.transport.nixl import NixlEndpoint

log = logging.getLogger(__name__)
_MIN_SLOT = 64 << 10
_SLOTS_KEPT = 16  # (a sharded version has a descriptor per pulled class)


class PullServer:
    """One NIXL agent per trainer rank, started on the first offer; a lease per offered version."""

    def __init__(self) -> None:
        self._endpoint: NixlEndpoint | None = None
        # version -> (offered at, release by: time.monotonic(); its lease)
        self._leases: dict[int, tuple[float, float, contextlib.ExitStack]] = {}
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # descriptor slots no offered version holds (registered)

    def offer(self, cache: VersionCache, version: int, source_version: int | None, algo: DigestAlgo,
              hold_s: float, digests: Sequence[int] = (), *, lead: bool = True,
              classes: Mapping[str, PulledClass] | None = None, plan: WirePlan | None = None,
              kept: CachedVersion | None = None) -> PullOffer:
        """``version`` (a re-push: ``source_version``'s cached bytes under ``version``) offered; its buffer is
        held for at most ``hold_s``. ``digests`` and ``plan``: the send's per-piece digests and what they are of
        (a sparse version's changes), if it made them. ``lead``: rank 0, whose offer carries the descriptor;
        another owner rank offers its share alone. ``classes``: a sharded version's pulled classes (the lead
        offers a descriptor for each). ``kept``: a bypass_cpu version's share as its send kept it, offered in
        place of a cached one."""
        stack = contextlib.ExitStack()
        if kept is not None:  # (bypass_cpu's send slots: held by the publisher until its next pulled version)
            cached = kept
        else:
            cached = stack.enter_context(cache.lease(source_version if source_version is not None else version))
        endpoint = self._endpoint_now()
        try:
            if not lead:
                offered = offer_share(endpoint, cached, version=version)
            elif classes is not None:
                offered = offer_classes(endpoint, cached, classes, version=version, algo=algo,
                                        descriptor_into=self._slot)
            else:
                offered = offer_cached(endpoint, cached, version=version, algo=algo, descriptor_into=self._slot,
                                       digests=digests, plan=plan)
        except BaseException:
            stack.close()
            raise
        for descriptor in offered.descriptors:
            stack.callback(self._free_slot, descriptor)  # (released with the version's lease)
        with self._lock:
            earlier = self._leases.pop(version, None)
            now = time.monotonic()
            self._leases[version] = (now, now + hold_s, stack)
        if earlier is not None:
            earlier[2].close()
        endpoint.serve_for(hold_s)  # (pullers may read it until then: the agent is driven at its busy rate)
        return offered.offer

    def offer_for(self, assignment: Assignment, publisher: Publisher, settings: RegisterReply | None,
                  sent: TransferResult, rank: int) -> PullOffer:
        """What trainer rank ``rank`` offers of ``assignment`` (a send with pullers) once ``sent`` (its send)
        ended, the lead with that send's digests (a sharded version's: each pulled class's); held for the
        version's time limit at most."""
        classes = publisher.classes.pulled(assignment.version) if assignment.classes else None
        if classes is not None and rank == 0:
            wanted = {lane.key for lane in assignment.classes if lane.pullers}
            if missing := sorted(wanted - set(classes)):
                raise CkptEngineError(f"class(es) {[key[:12] for key in missing]} of version {assignment.version} "
                                      "were not sent: nothing to offer their pullers")
        kept = publisher.kept(assignment.version) if assignment.mode == "bypass_cpu" else None
        return self.offer(publisher.cache, assignment.version, assignment.source_version,
                          publisher.device.digest_algo, settings.version_timeout_s if settings is not None else 600.0,
                          sent.wire_digests, lead=rank == 0, classes=classes, plan=sent.wire_plan, kept=kept)

    def start(self) -> None:
        """Start the NIXL agent now (importing and starting it takes a second or two), not at the first offer."""
        try:
            self._endpoint_now()
        except CkptEngineError as exc:  # each offer says it again
            log.warning("the nixl transport cannot start here: %s", exc)

    def release(self, *, before: int | None = None) -> None:
        """Release the leases of versions older than ``before`` (the daemon has moved on from them) and of those
        whose time is up."""
        now = time.monotonic()
        self._release(lambda v, offered_at, until: now >= until or (before is not None and v < before))

    def ended(self, in_flight: int | None, asked_at: float) -> None:
        """The daemon had ``in_flight`` in flight (None: none) when it answered a question asked at
        ``asked_at``: the versions offered before that and no longer in flight have ended, and nothing pulls
        them any more."""
        self._release(lambda v, offered_at, until: v != in_flight and offered_at < asked_at)

    def _release(self, done: Callable[[int, float, float], bool]) -> None:
        with self._lock:
            stacks = [self._leases.pop(v)[2] for v in [v for v, (at, until, _) in self._leases.items()
                                                        if done(v, at, until)]]
            endpoint, idle = self._endpoint, not self._leases
        for stack in stacks:
            stack.close()
        if endpoint is not None and idle:
            endpoint.serve_for(0.0)

    def close(self) -> None:
        with self._lock:
            stacks = [stack for _, _, stack in self._leases.values()]
            self._leases.clear()
            endpoint, self._endpoint = self._endpoint, None
        for stack in stacks:
            stack.close()
        if endpoint is not None:
            endpoint.close()

    def _slot(self, nbytes: int) -> torch.Tensor:
        """Registered memory for a descriptor, reused once its version is released: the agent's metadata then
        stays the same from version to version, and pullers need not load it again."""
        with self._lock:
            fitting = [t for t in self._free if t.numel() >= nbytes]
            if fitting:
                slot = min(fitting, key=torch.Tensor.numel)
                self._free = [t for t in self._free if t is not slot]
                return slot
        return torch.empty(max(_MIN_SLOT, 1 << (nbytes - 1).bit_length()), dtype=torch.uint8)

    def _free_slot(self, slot: torch.Tensor) -> None:
        with self._lock:
            self._free.append(slot)
            drop = sorted(self._free, key=torch.Tensor.numel)[:-_SLOTS_KEPT] if len(self._free) > _SLOTS_KEPT else []
            self._free = [t for t in self._free if all(t is not d for d in drop)]
            endpoint = self._endpoint
        for slot in drop:
            if endpoint is not None:
                endpoint.forget(slot)

    @property
    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._leases)

    def _endpoint_now(self) -> NixlEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = NixlEndpoint("trainer")
            return self._endpoint
