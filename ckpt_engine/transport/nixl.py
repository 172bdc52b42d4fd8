"""The pull transport's engine: NIXL (UCX underneath: RDMA, NVLink / cuda_ipc, shared memory, or TCP).

One NIXL agent per process. An owner registers the memory it serves once and hands out its agent's metadata and
regions; a puller registers the buffers it reads into once, adds each owner's agent once, and READs byte ranges
of the owner's regions into its own. Nothing forms a group: a puller that joins or dies costs no one else.

NIXL ships per CUDA major version (``nixl-cu12``, ``nixl-cu13``; the CPU works with either). The ``nixl``
meta-package picks one by detecting a CUDA runtime and can pick one that is not installed, so the installed
backend module is imported directly.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import operator
import os
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckpt_engine.errors import CkptEngineError, SyncTimeoutError
from ckpt_engine.retry import Backoff

if TYPE_CHECKING:
    import numpy.typing as npt

log = logging.getLogger(__name__)
_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
# How often reads given up on are checked (see NixlEndpoint._reap), and how long close() waits for them.
_REAP_S = 0.05
CLOSE_DRAIN_S = 10.0
INSTALL_HINT = "pip install nixl-cu12 (CPU and CUDA 12) or nixl-cu13 (CUDA 13)"
# NIXL's UCX backend asks UCX for peer error handling by default. UCX then refuses every transport without a peer
# failure handler: shared memory (posix, sysv) and cuda_ipc. On one host a READ then falls back to software
# emulation over TCP loopback, owner-driven: 0.5 GB/s on an H200 where CUDA IPC moves 100 GB/s (docs/gpu-runs.md,
# 2026-11-28). Our reads do not need UCX to notice a dead peer: every read has its deadline, and a failed one fails
# its version only (tested with owners and pullers killed, over TCP too). One known exception, with "peer" too: over
# TCP an owner stopped mid-read aborts inside UCX if its puller's process ends meanwhile (a UCX defect:
# docs/architecture.md). "peer" restores NIXL's default.
UCX_ERROR_HANDLING_ENV = "CKPT_NIXL_UCX_ERROR_HANDLING"
UCX_ERROR_HANDLING_MODES = ("none", "peer")


class NixlUnavailable(CkptEngineError):
    """NIXL is not installed here (or its agent cannot start)."""


class PullFailed(CkptEngineError):
    """A READ from an owner failed (it died, deregistered, or its transport broke)."""


def nixl_missing() -> str | None:
    """Why the nixl transport cannot run here (None: it can)."""
    try:
        nixl_api()
    except NixlUnavailable as exc:
        return str(exc)
    return None


def ucx_error_handling(environ: Mapping[str, str] = os.environ) -> str:
    """The UCX error handling mode NIXL's backend is created with: ``none`` unless the environment says."""
    mode = environ.get(UCX_ERROR_HANDLING_ENV, "none").strip().lower() or "none"
    if mode not in UCX_ERROR_HANDLING_MODES:
        raise NixlUnavailable(f"{UCX_ERROR_HANDLING_ENV}={environ[UCX_ERROR_HANDLING_ENV]!r}: expected one of "
                              f"{', '.join(UCX_ERROR_HANDLING_MODES)}")
    return mode


@dataclass(frozen=True)
class Region:
    """Registered memory: where it starts, its bytes, and NIXL's memory kind and device."""

    addr: int
    nbytes: int
    mem: str  # "DRAM" or "VRAM"
    device_id: int


def nixl_api() -> Any:
    """The installed NIXL backend module (its ``nixl_agent``, ``nixl_agent_config``)."""
    failures = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # (also the meta-package's "detected CUDA 13 but nixl-cu13 is not installed")
            failures.append(f"{name}: {exc}")
    raise NixlUnavailable(f"the nixl transport needs NIXL: {INSTALL_HINT} ({'; '.join(failures)})")


def region_of(tensor: torch.Tensor) -> Region:
    """The whole storage under ``tensor`` (registered whole: every later view of it is then covered)."""
    storage = tensor.untyped_storage()
    device = tensor.device
    mem = "VRAM" if device.type in ("cuda", "npu") else "DRAM"
    return Region(storage.data_ptr(), storage.nbytes(), mem, device.index or 0 if mem == "VRAM" else 0)


# How often this process's agent is driven (see NixlEndpoint._progress): while reads may be served or are in
# flight, and otherwise (a puller's connection then waits at most this long to be taken). 0.5 ms, not less:
# with eight processes on two cores, 0.1 ms spent the cores the reads needed (a 64 MiB read over TCP took
# 0.05 s at 0.1 ms and 0.035 s at 0.5 ms; bench netns, sharded TP 4 from 4 owners: 0.62 s and 0.58 s).
BUSY_PROGRESS_S = 0.0005
IDLE_PROGRESS_S = 0.002
_READ_BUSY_S = 2.0  # after a read starts (each read refreshes it)
# How often, at most, a waiter asks whether its read ended: each millisecond it sleeps past the end is a
# millisecond the puller's next read (and, after the last, the version) waits.
READ_POLL_MAX_S = 0.002


class NixlEndpoint:
    """This process's NIXL agent. Thread-safe (the agent itself serializes its calls); registrations and remote
    agents are kept until :meth:`close` or until their users let go of them. Memory a read given up on may
    still write into, and the agent it reads from, are kept until that read ends (:meth:`retire`).

    UCX over TCP serves a READ only while the owner's side is driven (on one host, shared memory and cuda_ipc reads
    are one-sided: see UCX_ERROR_HANDLING_ENV). NIXL's own progress thread does that by spinning a whole core, idle
    or not (nixl-cu12 1.5 runs it without a pause); a thread of ours drives the agent instead, every
    BUSY_PROGRESS_S while reads may come (``serve_for``) or are in flight, and every IDLE_PROGRESS_S otherwise: a
    few percent of a core."""

    _names = itertools.count()

    def __init__(self, role: str) -> None:
        api = nixl_api()
        self.name = f"ckpt-{role}-{os.getpid()}-{next(self._names)}-{uuid.uuid4().hex[:8]}"
        mode = ucx_error_handling()
        try:
            config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                           sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self._agent = api.nixl_agent(self.name, config)
            self._agent.create_backend("UCX", {**self._agent.get_plugin_params("UCX"),
                                               "ucx_error_handling_mode": mode})
        except Exception as exc:
            raise NixlUnavailable(f"NIXL's UCX agent did not start: {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], tuple[Region, Any, torch.Tensor]] = {}
        self._remotes: dict[bytes, str] = {}
        self._reads: set[Read] = set()  # started and not yet released (see Read)
        self._retired: list[torch.Tensor] = []  # see retire
        self._dropping: set[str] = set()  # remote agents to remove once no read from them is in flight
        self._busy_until = 0.0  # time.monotonic() until which the agent is driven at the busy rate
        self._closing = threading.Event()
        self._driver = threading.Thread(target=self._progress, name="ckpt-nixl-progress", daemon=True)
        self._driver.start()

    def serve_for(self, seconds: float) -> None:
        """Reads of what this process offers may come for ``seconds`` from now (0: none are expected now)."""
        self._busy_until = time.monotonic() + seconds

    def _progress(self) -> None:
        reaped_at = time.monotonic()
        while not self._closing.wait(BUSY_PROGRESS_S if time.monotonic() < self._busy_until else IDLE_PROGRESS_S):
            try:
                self._agent.get_new_notifs()  # (drives the UCX worker: connections, and the reads it serves)
            except Exception as exc:  # noqa: BLE001 - a later turn tries again; reads fail on their own
                log.debug("driving the NIXL agent: %s", exc)
            if time.monotonic() - reaped_at >= _REAP_S:
                reaped_at = time.monotonic()
                self._reap()

    def _reap(self) -> None:
        """Release the reads given up on that have ended, then remove the remote agents and deregister the
        retired memory that no read in flight uses any more."""
        with self._lock:
            abandoned = [read for read in self._reads if read.abandoned]
        for read in abandoned:
            read.settle_if_ended()
        with self._lock:
            busy = {read.remote for read in self._reads}
            written = {key for read in self._reads for key in read.writes}
            names = [name for name in self._dropping if name not in busy]
            self._dropping -= set(names)
            freed = [t for t in self._retired if _key(t) not in written]
            self._retired = [t for t in self._retired if _key(t) in written]
        for tensor in freed:
            self.forget(tensor)
        for name in names:
            self._remove_agent(name)

    @property
    def in_flight(self) -> int:
        """Reads started and not yet released (given up on ones included)."""
        with self._lock:
            return len(self._reads)

    def metadata(self) -> bytes:
        """What a puller needs to reach this agent (NIXL's own bytes: opaque here)."""
        return bytes(self._agent.get_agent_metadata())

    def register(self, tensor: torch.Tensor) -> Region:
        """Register the storage under ``tensor`` once (kept alive while registered); its region."""
        region = region_of(tensor)
        key = (region.addr, region.nbytes)
        with self._lock:
            if key not in self._registered:
                whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                    tensor.untyped_storage(), 0, (region.nbytes,), (1,))
                handle = self._agent.register_memory([(region.addr, region.nbytes, region.device_id, "")],
                                                     region.mem)
                self._registered[key] = (region, handle, whole)
            return self._registered[key][0]

    def forget(self, tensor: torch.Tensor) -> None:
        """Deregister the storage under ``tensor`` (its owner frees it)."""
        with self._lock:
            entry = self._registered.pop(_key(tensor), None)
        if entry is not None:
            self._agent.deregister_memory(entry[1])

    def remote(self, metadata: bytes) -> str:
        """The name of the agent ``metadata`` describes, added once (an owner's metadata changes as it registers
        more memory: the newest replaces the ones before it)."""
        with self._lock:
            name = self._remotes.get(metadata)
            if name is None:
                try:
                    name = self._agent.add_remote_agent(metadata)
                except Exception as exc:
                    raise PullFailed(f"an owner's NIXL metadata was refused: {type(exc).__name__}: {exc}") from exc
                self._remotes = {m: n for m, n in self._remotes.items() if n != name}
                self._remotes[metadata] = name
                self._dropping.discard(name)  # (in use again)
            return name

    def retire(self, tensors: Sequence[torch.Tensor]) -> None:
        """Memory its user is done with, though a read given up on may still write into it: every read into it
        still in flight is given up on, and it stays registered, so alive, until none is (an owner that resumes
        late still writes: over TCP its replies land even after its agent was removed)."""
        keys = {_key(t) for t in tensors}
        with self._lock:
            self._retired += [t for t in tensors if _key(t) not in {_key(r) for r in self._retired}]
            reads = [read for read in self._reads if read.writes & keys]
        for read in reads:
            read.abandon()

    def drop_remote(self, metadata: bytes) -> None:
        """Forget an owner (it died, restarted or stalled): its next metadata is added afresh. Its agent is
        removed once no read from it is in flight: NIXL then no longer says whether a read ended, and a late
        one still writes."""
        with self._lock:
            name = self._remotes.pop(metadata, None)
            if name is None:
                return
            self._remotes = {m: n for m, n in self._remotes.items() if n != name}
            if any(read.remote == name for read in self._reads):
                self._dropping.add(name)
                return
        self._remove_agent(name)

    def _remove_agent(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("removing remote agent %s: %s", name, exc)

    def keep_remotes(self, kept: Collection[bytes]) -> None:
        """Forget every owner but those ``kept`` describes (an offer's owners): a trainer rank that is gone is
        never read again, and its agent is not kept until a read of it fails."""
        with self._lock:
            names = {self._remotes[m] for m in kept if m in self._remotes}
            gone = [m for m, n in self._remotes.items() if n not in names]
        for metadata in gone:
            self.drop_remote(metadata)

    def start_read(self, remote: str, source: Region, into: torch.Tensor,
                   ranges: torch.Tensor | None = None, at: int = 0) -> Read:
        """READ into ``into`` (a uint8 tensor within memory registered here), for each row (byte offset in
        ``source`` after ``at``, byte offset in ``into``, bytes) of ``ranges`` (int64 [n, 3]; default: all of
        ``into``, from ``at``), those bytes from the owner. Returns the transfer to wait on. The ranges are
        checked and handed to NIXL as arrays (numpy: a bucket's few rows cost microseconds, not a torch op's
        overhead each): a column piece is one range a row, a million for a 70B class."""
        import numpy as np  # (NIXL's own dependency, so there wherever a read is: not imported with this module)

        nbytes = into.numel() * into.element_size()
        if not into.is_contiguous():
            raise PullFailed("a read's local buffer must be contiguous (its bytes are read as one span)")
        if source.addr < 0 or source.nbytes < 0 or source.addr + source.nbytes >= 1 << 63:  # (no process maps there)
            raise PullFailed(f"an owner's region at {source.addr} of {source.nbytes} bytes is not an address range")
        try:
            at = operator.index(at)  # (a float would be rounded into an address)
        except TypeError:
            raise PullFailed(f"where a read starts in an owner's region is a byte count, not {at!r}") from None
        if not 0 <= at <= source.nbytes:
            raise PullFailed(f"a read {at} bytes into an owner's region of {source.nbytes} leaves it")
        if ranges is None:
            rows = np.array([[0, 0, nbytes]], dtype=np.int64)
        elif ranges.dtype != torch.int64 or ranges.dim() != 2 or ranges.shape[1] != 3:
            raise PullFailed(f"a read's ranges are int64 rows of 3 (owner offset, local offset, bytes), not "
                             f"{ranges.dtype} {tuple(ranges.shape)}")
        else:
            rows = ranges.numpy()
        _check_within(rows[:, 0], rows[:, 2], source.nbytes - at, "the owner's region")
        _check_within(rows[:, 1], rows[:, 2], nbytes, "the memory it reads into")
        rows = rows[rows[:, 2] > 0]
        if not len(rows):
            return Read(self, None, remote, [])
        device_id, mem = self._kind(into)
        local = np.empty((len(rows), 3), dtype=np.uint64)  # (every value < 2**63: checked above)
        local[:, 0], local[:, 1], local[:, 2] = rows[:, 1] + into.data_ptr(), rows[:, 2], device_id
        far = np.empty((len(rows), 3), dtype=np.uint64)
        far[:, 0], far[:, 1], far[:, 2] = rows[:, 0] + (source.addr + at), rows[:, 2], source.device_id
        try:
            local_descs = self._agent.get_xfer_descs(local, mem)
            remote_descs = self._agent.get_xfer_descs(far, source.mem)
            self._busy_until = max(self._busy_until, time.monotonic() + _READ_BUSY_S)  # (this side too: TCP, shm)
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            state = self._agent.transfer(handle)
        except Exception as exc:
            raise PullFailed(f"a read from {remote} could not start: {type(exc).__name__}: {exc}") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise PullFailed(f"a read from {remote} failed as it started")
        read = Read(self, handle, remote, [into])
        with self._lock:
            self._reads.add(read)
        return read

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Release everything, after waiting up to ``drain_s`` for reads still in flight (given up on: their
        owner stopped answering) to end. One that has not is left to the process's exit, which NIXL may not
        survive, and over TCP an owner that resumes after it may abort (a defect of UCX's software reads:
        docs/workers.md)."""
        deadline = time.monotonic() + drain_s
        while self.in_flight and time.monotonic() < deadline:
            self._abandon_all()
            time.sleep(_REAP_S)
        if self.in_flight:
            log.warning("closing the NIXL agent with %d read(s) still in flight: their owners stopped answering",
                        self.in_flight)
        self._closing.set()
        self._driver.join(timeout=5.0)
        with self._lock:
            entries, self._registered = list(self._registered.values()), {}
            remotes = [*self._remotes.values(), *self._dropping]
            self._remotes, self._dropping, self._retired = {}, set(), []
        for _, handle, _ in entries:
            try:
                self._agent.deregister_memory(handle)
            except Exception as exc:  # noqa: BLE001 - closing: best effort
                log.debug("deregistering: %s", exc)
        for name in set(remotes):
            self._remove_agent(name)

    def _abandon_all(self) -> None:
        with self._lock:
            reads = list(self._reads)
        for read in reads:
            read.abandon()

    def _settled(self, read: Read) -> None:
        with self._lock:
            self._reads.discard(read)

    def _kind(self, view: torch.Tensor) -> tuple[int, str]:
        region = region_of(view)
        if (region.addr, region.nbytes) not in self._registered:
            raise PullFailed("a read's local buffer is not registered with this process's NIXL agent")
        return region.device_id, region.mem


def _check_within(offsets: npt.NDArray[Any], counts: npt.NDArray[Any], nbytes: int, what: str) -> None:
    """Every (offset, count) lies in ``nbytes`` bytes; compared without adding them (int64 would wrap)."""
    if bool(((offsets < 0) | (counts < 0) | (offsets > nbytes) | (counts > nbytes - offsets)).any()):
        raise PullFailed(f"a read leaves {what} ({nbytes} bytes)")


def _key(tensor: torch.Tensor) -> tuple[int, int]:
    """The storage under ``tensor``, as registrations are keyed."""
    region = region_of(tensor)
    return region.addr, region.nbytes


class Read:
    """One READ in flight, from agent ``remote`` into ``into`` (kept alive until it is released). A read is
    released once it ended; one given up on (its wait timed out, or its user retired the memory it writes
    into) is released by its endpoint when it ends, not before: NIXL cannot release a transfer in flight."""

    def __init__(self, endpoint: NixlEndpoint, handle: Any, remote: str, into: list[torch.Tensor]) -> None:
        self._endpoint, self._handle, self.remote, self._into = endpoint, handle, remote, into
        self.writes = {_key(view) for view in into}
        self.abandoned = False
        self._lock = threading.Lock()

    def wait(self, timeout_s: float) -> None:
        """Until the bytes are here; PullFailed if the owner failed it, SyncTimeoutError after ``timeout_s``
        (the read is then given up on)."""
        if self._handle is None:
            return
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(initial_s=0.0002, max_s=READ_POLL_MAX_S)
        while True:
            try:
                state = self._state()
            except Exception as exc:  # (e.g. nixlRemoteDisconnectError: the owner died mid-read, over TCP)
                self._settle()
                raise PullFailed(f"a read from an owner failed: {type(exc).__name__}: {exc}") from exc
            if state is None:
                raise PullFailed("a read was given up on while it was waited for (its endpoint is closing)")
            if state == "DONE":
                self._settle()
                return
            if state == "ERR":
                self._settle()
                raise PullFailed("a read from an owner failed (it died, or deregistered what it served)")
            if time.monotonic() >= deadline:
                self.abandon()
                raise SyncTimeoutError(f"a read from an owner did not finish within {timeout_s:.0f}s")
            backoff.wait()

    def ended(self) -> bool:
        """Whether it ended, whichever way (a wait then returns or raises at once)."""
        try:
            return self._state() != "PROC"
        except Exception:  # noqa: BLE001 - its owner died: the transfer is over
            return True

    def abandon(self) -> None:
        """Nobody waits for it any more: its endpoint releases it once it ends."""
        self.abandoned = True

    def settle_if_ended(self) -> None:
        """(The endpoint's, for a read given up on) Release it if it ended, whichever way."""
        try:
            ended = self._state() != "PROC"
        except Exception:  # noqa: BLE001 - its owner died: the transfer is over
            ended = True
        if ended:
            self._settle()

    def _state(self) -> str | None:
        """NIXL's state of the transfer; None once it is released. Under the read's lock: a handle is never
        checked while another thread releases it (the endpoint's reaper, and a waiter while it closes)."""
        with self._lock:
            return None if self._handle is None else self._endpoint._agent.check_xfer_state(self._handle)

    def _settle(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            self._endpoint._agent.release_xfer_handle(handle)
        except Exception as exc:  # noqa: BLE001 - an ended transfer NIXL will not release: nothing more to do
            log.debug("releasing a NIXL transfer: %s", exc)
        self._into = []
        self._endpoint._settled(self)
