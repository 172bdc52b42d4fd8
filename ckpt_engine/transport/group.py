"""The sync group: a process group of its own (sender + receivers), independent of any default group.

It is built directly from a backend class (``ProcessGroupGloo``, ``ProcessGroupNCCL``, HCCL), so a trainer's
``torch.distributed`` default group is never touched. Its ``PrefixStore`` prefix names the group and its
generation, so a rebuilt group never reads keys of an older one. Every wait has a timeout. After a failed or
timed-out collective the group is marked broken and must be rebuilt.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckpt_engine.device import DeviceInfo, set_current
from ckpt_engine.errors import CkptEngineError, ConfigError, GroupBrokenError, SyncTimeoutError
from ckpt_engine.ranks import GroupRank

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_STORE_GRACE_S = 2.0  # how long past the store's own timeout a store call is given up on from outside
# Values of an exchange's first allgather: an owners' vote of one version (a plan and a share's digests) fits
EXCHANGE_WORDS = 512


class MembersAbsent(SyncTimeoutError):
    """A group's rendezvous or exchange failed. ``absent``: the group ranks that never came to it. The daemon
    benches those, never the ones that came and waited."""

    def __init__(self, message: str, absent: Iterable[GroupRank] = ()) -> None:
        super().__init__(message)
        self.absent: tuple[GroupRank, ...] = tuple(absent)


def absent_of(exc: BaseException) -> tuple[GroupRank, ...]:
    """The group ranks a failure names as never having come; none for any other failure."""
    return exc.absent if isinstance(exc, MembersAbsent) else ()


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def bounded(call: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """Run ``call()`` (a store operation), giving up after ``timeout_s``. torch's store client enforces its
    timeouts against a server that is gone, but not against one that accepted the connection and then stopped
    (stalled, SIGSTOPped, swapping); a call on that blocks for good. So the call runs on a helper thread, which
    works because store calls release the GIL. Past the bound the caller gets a SyncTimeoutError, and the
    helper stays blocked until that server answers or goes away."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = exc

    helper = threading.Thread(target=run, name="ckpt-store-call", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        raise SyncTimeoutError(f"{what}: no answer within {timeout_s:.1f}s (the store's process is stalled?)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def open_store(host: str, port: int, *, is_master: bool = False, timeout_s: float = 30.0) -> dist.TCPStore:
    """A TCP store client, or the server with ``is_master``. ``port=0`` with ``is_master`` picks a free port."""
    def connect() -> dist.TCPStore:
        return dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=_td(timeout_s))

    try:
        if is_master:
            return connect()
        return bounded(connect, timeout_s + _STORE_GRACE_S, f"the rendezvous store at {host}:{port}")
    except (RuntimeError, dist.DistError) as exc:
        raise SyncTimeoutError(f"cannot reach the rendezvous store at {host}:{port}: {exc}") from exc


def wait_for_key(store: dist.Store, key: str, timeout_s: float) -> bytes:
    """``key``'s value once it is set, within ``timeout_s``, even against a stalled store server."""
    def get() -> bytes:
        store.wait([key], _td(timeout_s))
        return store.get(key)

    return bounded(get, timeout_s + _STORE_GRACE_S, f"waiting for {key!r} in the rendezvous store")


def serve_store(host: str, port: int, *, timeout_s: float = 30.0) -> dist.TCPStore:
    """The TCP store server, listening on ``host`` only. TCPStore alone listens on every interface whatever
    host it is given, so here it gets a socket bound to ``host``. Port 0 picks a free port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        raise SyncTimeoutError(f"cannot listen for the rendezvous store on {host}:{port}: {exc}") from exc
    bound = listener.getsockname()[1]
    try:  # the store owns the descriptor from here on and closes it
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=_td(timeout_s),
                             master_listen_fd=listener.detach())
    except (RuntimeError, dist.DistError) as exc:
        raise SyncTimeoutError(f"cannot start the rendezvous store on {host}:{bound}: {exc}") from exc


def store_prefix(name: str, generation: int) -> str:
    return f"ckpt-engine/{name}/gen-{generation}/"


def owner_part(owner: int) -> str:
    """The store part of owner ``owner``'s sync group within a generation. Owner 0's is the generation's own."""
    return "" if owner == 0 else f"owner-{owner}/"


class SyncGroup:
    """One generation of a sync group. Rank 0 is the sender by convention; the others receive."""

    def __init__(
        self,
        store: dist.Store,
        *,
        name: str,
        generation: int,
        rank: int,
        world_size: int,
        device: DeviceInfo,
        timeout_s: float = 60.0,
        bind_host: str | None = None,
        connect_timeout_s: float | None = None,
        prefix: str | None = None,
        part: str = "",
        label: str | None = None,
    ) -> None:
        """``part``: one of several groups of a generation (``owner-2/``, ``owners/``), under the generation's
        prefix. ``prefix`` replaces the default store prefix ``ckpt-engine/<name>/gen-<generation>/``, for
        groups whose other members follow another project's convention (an inference engine's update group).
        ``label``: who this member is (e.g. ``rollout worker 1``), so errors can name a peer that went away."""
        if world_size < 2:
            raise ConfigError(f"a sync group needs a sender and at least one receiver, got world_size={world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self.name = name
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.broken: str | None = None
        # Set once a collective went through, proving every member really joined. The store only says they
        # announced themselves, and takes any member's word for its address.
        self.carried = False
        connect_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        self.part = part
        prefixed = dist.PrefixStore(prefix if prefix is not None else store_prefix(name, generation) + part, store)
        prefixed.set_timeout(_td(connect_s))
        self._store = prefixed
        started = time.monotonic()
        try:
            # Members of a group under another project's prefix do not follow our rendezvous: NCCL stays lazy.
            self._pg = _construct(prefixed, rank, world_size, device, timeout_s, bind_host, own=prefix is None,
                                  connect_s=connect_s, label=label)
        except Exception as exc:
            absent = absent_members(prefixed, world_size, device.backend) if prefix is None else []
            who = f"; rank(s) {absent} never joined" if absent else ""
            raise MembersAbsent(
                f"sync group {name!r} gen {generation}: rank {rank} could not rendezvous with "
                f"{world_size - 1} peer(s) within {connect_s:.1f}s ({time.monotonic() - started:.1f}s){who}: {exc}",
                absent) from exc
        self._rung = 0  # doorbells rung (sender) or heard (receiver) on this group; see ring()
        log.info("sync group %s gen %d up: rank %d/%d on %s", name, generation, rank, world_size, device.backend)

    def ring(self) -> None:
        """Ring the receivers' doorbell: the sender is about to open a version, abort one before it began, or
        close. Receivers wait for this in the store, bounded by the version's time limit, rather than in a
        collective bounded by the backend's timeout: the sender begins at its next step boundary, maybe minutes
        after the rendezvous."""
        key, self._rung = f"{_RING_KEY}{self._rung}", self._rung + 1
        try:
            bounded(lambda: self._store.set(key, b"1"),  # type: ignore[arg-type]  # the stub says str; bytes work
                    _STORE_GRACE_S + self.timeout_s, "ringing the receivers")
        except Exception as exc:
            raise self._fail(f"could not ring the receivers (its rendezvous store is unreachable): {exc}",
                             SyncTimeoutError) from exc

    def await_ring(self, timeout_s: float, abandon: Callable[[], str | None] | None = None) -> str | None:
        """For a receiver: wait up to ``timeout_s`` until the sender rings for the next version's first frame,
        then return None. ``abandon()`` is asked every second. A reason it gives means the version will not come
        (a newer one is assigned, the daemon restarted): the wait ends, the reason is returned, and the doorbell
        is not taken."""
        key, deadline = f"{_RING_KEY}{self._rung}", time.monotonic() + timeout_s
        while True:
            step = min(_RING_CHECK_S, deadline - time.monotonic()) if abandon is not None else timeout_s
            try:
                wait_for_key(self._store, key, max(step, 0.01))
                break
            except (RuntimeError, dist.DistError, SyncTimeoutError) as exc:
                reason = abandon() if abandon is not None else None
                if reason is not None:
                    return reason
                if time.monotonic() >= deadline or abandon is None or _store_gone(exc):
                    raise SyncTimeoutError(f"sync group {self.name!r} gen {self.generation}: the sender did not "
                                           f"begin a version within {timeout_s:.1f}s") from exc
        self._rung += 1
        return None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast from ``src``; returns a work handle for :meth:`wait`."""
        self._check_usable()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        try:
            return self._pg.broadcast([tensor], opts)
        except Exception as exc:
            raise self._fail(f"broadcast could not start: {exc}") from exc

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for ``work``. A timeout or peer failure marks the group broken and raises."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(_td(limit))
            self.carried = True
        except Exception as exc:
            text = str(exc)
            gone = "".join(f"; {who}" for who in gone_members(self._store, self.world_size, self.rank))
            if "imed out" in text or "timeout" in text.lower():
                raise self._fail(f"{what} timed out after {limit:.1f}s{gone}", SyncTimeoutError) from exc
            raise self._fail(f"{what} failed{gone}: {text}") from exc

    def broadcast_and_wait(self, tensor: torch.Tensor, what: str, src: int = 0) -> None:
        self.wait(self.broadcast(tensor, src), what)

    def allgather(self, tensor: torch.Tensor, what: str, timeout_s: float | None = None) -> list[torch.Tensor]:
        """Every rank contributes ``tensor``, of the same size everywhere. Returns one tensor per rank."""
        self._check_usable()
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = self._pg.allgather([outputs], [tensor])
        except Exception as exc:
            raise self._fail(f"{what} could not start: {exc}") from exc
        self.wait(work, what, timeout_s)
        return outputs

    def exchange_ints(self, values: list[int], what: str, timeout_s: float | None = None, *,
                      round_id: tuple[str, int] | None = None) -> list[list[int]]:
        """Every rank contributes a list of int64 values, of any length. Returns every rank's, in rank order.
        One allgather carries every rank's length and its first ``EXCHANGE_WORDS`` values; only when a rank has
        more does a second carry the rest (each collective step waits behind whatever fills the links). Both
        together take at most ``timeout_s``. ``round_id`` (kind, number): each rank notes in the store that it
        came to each step of this round, so that a failed exchange names the ranks that never came
        (``MembersAbsent``)."""
        try:  # (all of them before any step: a value past int64 found between the steps would leave the group
            mine = torch.tensor(values, dtype=torch.int64).reshape(-1)  # out of step, pairing wrong collectives)
        except (OverflowError, RuntimeError, TypeError, ValueError) as exc:
            raise self._fail(f"{what}: this rank's values are not int64 ({exc}); the others wait for it in "
                             "vain") from exc
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        head = torch.zeros(1 + EXCHANGE_WORDS, dtype=torch.int64)
        head[0] = len(mine)
        head[1 : 1 + min(len(mine), EXCHANGE_WORDS)] = mine[:EXCHANGE_WORDS]
        heads = self._exchange_step(head, what, deadline, round_id)
        sizes = [int(h[0]) for h in heads]
        told = [h[1 : 1 + min(size, EXCHANGE_WORDS)].tolist() for h, size in zip(heads, sizes, strict=True)]
        longest = max(sizes)
        if longest <= EXCHANGE_WORDS:
            return told
        tail = torch.zeros(longest - EXCHANGE_WORDS, dtype=torch.int64)
        tail[: max(len(mine) - EXCHANGE_WORDS, 0)] = mine[EXCHANGE_WORDS:]
        rest = (f"{round_id[0]}/rest", round_id[1]) if round_id is not None else None
        tails = self._exchange_step(tail, f"{what} (rest)", deadline, rest)
        return [first + t[: max(size - EXCHANGE_WORDS, 0)].tolist()
                for first, t, size in zip(told, tails, sizes, strict=True)]

    def _exchange_step(self, tensor: torch.Tensor, what: str, deadline: float,
                       round_id: tuple[str, int] | None) -> list[torch.Tensor]:
        """One allgather of an exchange, on the host; a failed one names the ranks that never came to it."""
        if round_id is not None:
            self._note_present(round_id)
        try:
            gathered = self.allgather(tensor.to(self.device.comm_device), what,  # (a wait of 0 would be unbounded)
                                      max(deadline - time.monotonic(), 0.01))
        except CkptEngineError as exc:
            absent = self._absent_from(round_id) if round_id is not None else []
            if not absent:
                raise
            raise MembersAbsent(f"{exc}; rank(s) {absent} never came to it", absent) from exc
        return [g.cpu() for g in gathered]

    def say(self, topic: str, text: str) -> None:
        """Leave ``text`` for the other members under ``topic``, best effort and bounded. E.g. why this rank
        voted no, since the vote itself carries only a flag."""
        try:
            bounded(lambda: self._store.set(f"said/{topic}/{self.rank}",
                                            text[:2000].encode(errors="replace")),  # type: ignore[arg-type]
                    _STORE_GRACE_S, "leaving a note")
        except Exception as exc:  # noqa: BLE001 - only the text of an error depends on it
            log.debug("sync group %s: could not leave a note: %s", self.name, exc)

    def heard(self, topic: str, ranks: list[int]) -> dict[int, str]:
        """What those of ``ranks`` that said something said under ``topic``."""
        def read() -> dict[int, str]:
            keys = {rank: f"said/{topic}/{rank}" for rank in ranks}
            return {rank: self._store.get(key).decode(errors="replace") for rank, key in keys.items()
                    if self._store.check([key])}

        try:
            return bounded(read, _STORE_GRACE_S, "reading notes")
        except Exception:  # noqa: BLE001 - the store is gone or stalled: nothing to add
            return {}

    def _note_present(self, round_id: tuple[str, int]) -> None:
        try:  # one key per rank and kind, overwritten every round, so the store does not grow
            bounded(lambda: self._store.set(f"present/{round_id[0]}/{self.rank}", str(round_id[1])),
                    _STORE_GRACE_S, "noting presence")
        except Exception as exc:  # noqa: BLE001 - only the error text of a failed exchange depends on it
            log.debug("sync group %s: could not note presence: %s", self.name, exc)

    def _absent_from(self, round_id: tuple[str, int]) -> list[GroupRank]:
        def came(rank: int) -> bool:
            key = f"present/{round_id[0]}/{rank}"
            return self._store.check([key]) and self._store.get(key).decode() == str(round_id[1])

        try:
            return bounded(lambda: [GroupRank(r) for r in range(self.world_size) if not came(r)], _STORE_GRACE_S,
                           "asking the rendezvous store who came")
        except Exception:  # noqa: BLE001 - the store itself is gone or stalled: nobody can be named
            return []

    def close(self) -> None:
        """Release the backend's resources. The group cannot be used afterwards."""
        if self.broken is None:
            self.broken = "closed"
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None:
            try:
                pg.abort() if self.broken != "closed" else pg.shutdown()
            except Exception as exc:  # noqa: BLE001 - closing a half-dead group must not raise over the real error
                log.debug("sync group %s shutdown: %s", self.name, exc)

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise GroupBrokenError(f"sync group {self.name!r} gen {self.generation} is unusable: {self.broken}")

    def _fail(self, reason: str, kind: type[Exception] = GroupBrokenError) -> Exception:
        self.broken = reason
        log.warning("sync group %s gen %d rank %d: %s", self.name, self.generation, self.rank, reason)
        return kind(f"sync group {self.name!r} gen {self.generation} rank {self.rank}: {reason}")


def _construct(
    store: dist.Store, rank: int, size: int, device: DeviceInfo, timeout_s: float, bind_host: str | None, *,
    own: bool = True, connect_s: float | None = None, label: str | None = None,
) -> Any:
    """The backend's process group. ``own``: every member is a SyncGroup, so NCCL can rendezvous and connect
    now. ``connect_s``: how long the rendezvous may take; ``timeout_s`` by default."""
    connect_s = timeout_s if connect_s is None else connect_s
    if own:
        bounded(lambda: await_members(store, rank, size, label), connect_s + _STORE_GRACE_S,
                f"rank {rank} announcing itself in the rendezvous store")
    if device.backend == "gloo":
        gloo = dist.ProcessGroupGloo
        options = gloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
        options._timeout = _td(timeout_s)
        options._devices = [gloo.create_device(hostname=bind_host) if bind_host else gloo.create_default_device()]
        # gloo connects within its operations' timeout, but a member that announced itself and never connects
        # must cost the rendezvous's bound, not a collective's. The attempt is left to end on its own.
        return bounded(lambda: gloo(store, rank, size, options), connect_s + _STORE_GRACE_S,
                       f"rank {rank} connecting gloo's full mesh")
    set_current(device)
    if device.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _td(timeout_s)
        with _nccl_failures_cleanup_only():
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        if own:
            _connect_now(pg, device, timeout_s)
        return pg
    if device.backend == "hccl":
        # Unverified without Ascend hardware: torch_npu exposes ProcessGroupHCCL with the NCCL-style signature.
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

        options = ProcessGroupHCCL.Options()
        options._timeout = _td(timeout_s)
        return ProcessGroupHCCL(store, rank, size, options)
    raise ConfigError(f"unknown backend {device.backend!r}")


_MEMBER_KEY = "ckpt-member/"
_RING_KEY = "ckpt-ring/"
_RING_CHECK_S = 1.0  # how often a receiver waiting for the doorbell asks whether its version will still come


def _store_gone(exc: BaseException) -> bool:
    """Whether a store error is not a wait running out but a broken connection: the store's daemon is gone."""
    text = str(exc).lower()
    return not ("timeout" in text or "timed out" in text or "no answer" in text)
# Where gloo's rendezvous (torch's gloo store wrapper) leaves each rank's address, under the group's prefix.
# A member that announced itself but never started gloo has none.
_GLOO_ADDRESS_KEY = "0/"
# Read by ProcessGroupNCCL's constructor. Its default (3, SkipCleanUp) has the NCCL watchdog take the whole
# process down when a collective fails or times out, so a rollout that dies or is slow to acknowledge would
# kill the trainer. 2 (CleanUpOnly) aborts the group's communicators and lets the failed wait raise, which
# marks the group broken, the same contract as on gloo.
_NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def await_members(store: dist.Store, rank: int, size: int, label: str | None = None) -> None:
    """Announce this rank in ``store`` (host, pid, label) and wait, up to the store's timeout, until all ranks
    have. gloo's constructor would wait too, but could not say who is missing. NCCL builds its communicator
    lazily, inside the first collective, where a missing peer blocks the caller with no timeout at all."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "label": label}
    store.set(f"{_MEMBER_KEY}{rank}", json.dumps(me).encode())  # type: ignore[arg-type]  # the stub says str
    store.wait([f"{_MEMBER_KEY}{r}" for r in range(size)])


def gone_members(store: dist.Store, size: int, own_rank: int) -> list[str]:
    """Members on this host whose process is gone, named as they announced themselves. For use after a
    collective failed: the backend's own text (e.g. gloo's "Connection closed by peer") names an address, not
    a peer."""
    host = socket.gethostname()

    def named() -> list[str]:
        out = []
        for rank in range(size):
            if rank == own_rank or not store.check([f"{_MEMBER_KEY}{rank}"]):
                continue
            try:
                member = json.loads(store.get(f"{_MEMBER_KEY}{rank}"))
            except ValueError:
                continue
            pid = member.get("pid")
            if member.get("host") == host and isinstance(pid, int) and not _process_alive(pid):
                who = member.get("label") or "a member"
                out.append(f"rank {rank} ({who}, pid {pid} on {host}) is gone")
        return out

    try:
        return bounded(named, _STORE_GRACE_S, "asking the rendezvous store who the members are")
    except Exception:  # noqa: BLE001 - the store itself is gone or stalled: nobody can be named
        return []


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: neither a zombie (dead, not yet reaped by its parent) nor exiting."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat_says_alive(stat.read())
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


_PF_EXITING = 0x4  # (linux/sched.h) set as a task starts to exit, before its sockets are closed


def stat_says_alive(stat: bytes) -> bool:
    """From a /proc/<pid>/stat line: not a zombie (dead, not yet reaped) nor exiting. Its peers see its sockets
    close while it exits, before it is a zombie: a collective that failed then must already count it gone."""
    fields = stat.rsplit(b")", 1)[1].split()
    return fields[0] != b"Z" and not int(fields[6]) & _PF_EXITING


def absent_members(store: dist.Store, size: int, backend: str = "gloo") -> list[GroupRank]:
    """After a failed rendezvous, the ranks that never came: those that never announced themselves or, when
    all did, those that never started the backend's own rendezvous (on gloo, never left their address). The
    daemon benches those, not the ranks that came and waited."""
    def missing(prefix: str) -> list[GroupRank]:
        return [GroupRank(r) for r in range(size) if not store.check([f"{prefix}{r}"])]

    def who() -> list[GroupRank]:
        return missing(_MEMBER_KEY) or (missing(_GLOO_ADDRESS_KEY) if backend == "gloo" else [])

    try:
        # A connection of its own: gloo's attempt may still wait on the group's, whose client serves one call
        # at a time.
        store = bounded(store.clone, _STORE_GRACE_S,  # type: ignore[attr-defined]  # not in torch's stubs
                        "connecting to the rendezvous store again")
        return bounded(who, _STORE_GRACE_S, "asking the rendezvous store who joined")
    except Exception:  # noqa: BLE001 - the store itself is gone: nobody can be named
        return []


@contextlib.contextmanager
def _nccl_failures_cleanup_only() -> Iterator[None]:
    name, value = _NCCL_ERROR_HANDLING
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _connect_now(pg: Any, device: DeviceInfo, timeout_s: float) -> None:
    """Build the NCCL communicator now, while every member is known to be there (see await_members)."""
    connect = getattr(pg, "eager_connect_single_device", None)
    if connect is not None:
        connect(device.torch_device)
        return
    opts = dist.BroadcastOptions()  # older torch has no eager connect: the first collective builds it
    pg.broadcast([torch.zeros(1, dtype=torch.uint8, device=device.torch_device)], opts).wait(_td(timeout_s))
