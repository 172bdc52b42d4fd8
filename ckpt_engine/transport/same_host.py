"""Same-host transport: a colocated receiver maps the sender's double-buffered bucket slots instead of
receiving them through a collective.

- Slots are memfd segments (``os.memfd_create``) mapped with ``torch.from_file``. They have no name in any
  filesystem, so nothing can be left behind in ``/dev/shm`` whoever is killed: the kernel frees a segment
  when its last mapping goes. On CUDA the slots are device buffers, shared once by CUDA IPC handle.
- The control channel is a Unix stream socket in the abstract namespace, so no file either, carrying
  length-prefixed msgpack frames. Slot descriptors travel once per slot (fds by SCM_RIGHTS); after that only
  per-bucket metadata does.
- Flow control: a slot is overwritten only after every receiver released the bucket it held. A receiver
  that does not release within the timeout is dropped, and the others go on.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from ckpt_engine.device import DeviceInfo, collect_shared
from ckpt_engine.errors import CkptEngineError, ProtocolError, SyncTimeoutError
from ckpt_engine.plan.tensors import forget_fill_views
from ckpt_engine.ranks import QuorumRank

log = logging.getLogger(__name__)
IPC_PROTO = 2  # 2 takes versions with chunked tensors; an older receiver says 1, or nothing
MAX_FRAME_BYTES = 64 << 20
_LEN = struct.Struct("<I")


def host_identity() -> str:
    """Equal for processes that can reach each other's abstract sockets and share memory: same kernel boot
    and same network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"{socket.gethostname()}:unknown"
    return f"{boot}:{netns}"


def abstract_address(name: str) -> str:
    return "\0" + name


class PeerGone(CkptEngineError):
    """The other side of an IPC channel closed it or stopped answering."""


class FramedSocket:
    """Length-prefixed msgpack frames over a Unix stream socket, with file descriptors attached when given."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        data = _LEN.pack(len(body)) + body
        try:
            with self._lock:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.sendall(data)
        except OSError as exc:
            raise PeerGone(f"IPC peer unreachable: {exc}") from exc

    def recv(self, timeout_s: float) -> tuple[dict[str, Any], list[int]]:
        """One frame and the descriptors that came with it. Raises PeerGone or SyncTimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        head, fds = self._read(_LEN.size, deadline, with_fds=True)
        (length,) = _LEN.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"IPC frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
        body, _ = self._read(length, deadline, with_fds=False)
        try:
            message = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise ProtocolError(f"undecodable IPC frame: {exc}") from exc
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ProtocolError("an IPC frame must be a map with a 'type'")
        return message, fds

    def _read(self, size: int, deadline: float, with_fds: bool) -> tuple[bytes, list[int]]:
        chunks: list[bytes] = []
        fds: list[int] = []
        got = 0
        while got < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.sock], [], [], remaining)[0]:
                raise SyncTimeoutError("IPC peer sent nothing within the timeout")
            try:
                if with_fds and not fds:
                    data, new_fds, _, _ = socket.recv_fds(self.sock, size - got, 16)
                    fds.extend(new_fds)
                else:
                    data = self.sock.recv(size - got)
            except OSError as exc:
                raise PeerGone(f"IPC peer connection failed: {exc}") from exc
            if not data:
                raise PeerGone("IPC peer closed the connection")
            chunks.append(data)
            got += len(data)
        return b"".join(chunks), fds

    def readable(self, timeout_s: float) -> bool:
        """True once a frame, or the peer's close, is waiting; False after ``timeout_s``."""
        try:
            return bool(select.select([self.sock], [], [], max(timeout_s, 0.0))[0])
        except (OSError, ValueError):  # closed under us: the next read says how it failed
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class SharedSlot:
    """One bucket-sized buffer both sides map."""

    index: int
    nbytes: int
    tensor: torch.Tensor
    fd: int | None = None  # memfd for host slots

    @property
    def is_cuda(self) -> bool:
        return self.tensor.device.type == "cuda"

    def describe(self) -> dict[str, Any]:
        """What a receiver needs to map the slot. A CUDA slot gets a fresh IPC handle for every description,
        each with its own reference count, so every receiver that maps it holds the memory on its own. One
        handle shared by several receivers would be released by the first one to let go."""
        if self.is_cuda:
            return {"index": self.index, "nbytes": self.nbytes, "kind": "cuda",
                    "cuda_handle": _cuda_handle(self.tensor), "device_uuid": _device_uuid(self.tensor.device)}
        return {"index": self.index, "nbytes": self.nbytes, "kind": "memfd", "cuda_handle": None}

    def close(self) -> None:
        """Let the slot go. The views that fills keep into it would otherwise hold its memory (this process's
        mapping, or its device allocation) for as long as they are cached."""
        forget_fill_views(self.tensor)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def create_slot(index: int, nbytes: int, device: DeviceInfo) -> SharedSlot:
    if device.comm_device.type == "cuda":
        return SharedSlot(index, nbytes, torch.empty(nbytes, dtype=torch.uint8, device=device.comm_device))
    fd = os.memfd_create(f"ckpt-engine-slot{index}", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    return SharedSlot(index, nbytes, tensor, fd=fd)


def map_slot(description: dict[str, Any], fd: int | None, device: DeviceInfo) -> torch.Tensor:
    """The receiver's view of a sender's slot. A CUDA slot stays on the sender's GPU, whichever that is here."""
    nbytes = int(description["nbytes"])
    if description.get("kind", "memfd") == "cuda":
        return _open_cuda_handle(description, nbytes)
    if fd is None:
        raise ProtocolError("a memfd slot arrived without its file descriptor")
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping keeps the segment alive


# torch's CUDA IPC share tuple, as torch.multiprocessing.reductions passes it from _share_cuda_ to
# _new_shared_cuda: (device index, handle, storage bytes, storage offset, ref-counter handle, ref-counter
# offset, event handle, event sync flag). Every element is bytes, int or bool, so it travels as msgpack.
_SHARE_TUPLE_LEN = 8


def _cuda_handle(tensor: torch.Tensor) -> list[Any]:
    return list(tensor.untyped_storage()._share_cuda_())


def _device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID, since device indexes differ between processes with different CUDA_VISIBLE_DEVICES."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):  # an old torch without uuid: fall back to the index
        return None


def _local_cuda_index(description: dict[str, Any], sender_index: int) -> int:
    """This process's index of the sender's GPU, found by UUID; the sender's index when no UUID was sent."""
    uuid = description.get("device_uuid")
    if not isinstance(uuid, str):
        return sender_index
    for index in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise ProtocolError(f"the sender's slot is on GPU {uuid}, which this process cannot see "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")


def _open_cuda_handle(description: dict[str, Any], nbytes: int) -> torch.Tensor:
    handle = description.get("cuda_handle")
    if not isinstance(handle, list) or len(handle) != _SHARE_TUPLE_LEN or not isinstance(handle[0], int):
        raise ProtocolError("a CUDA slot needs torch's 8-element IPC share tuple")
    index = _local_cuda_index(description, handle[0])
    storage = torch.UntypedStorage._new_shared_cuda(index, *handle[1:])
    if storage.nbytes() < nbytes:
        raise ProtocolError(f"CUDA slot of {storage.nbytes()} bytes announced as {nbytes}")
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage, 0, (nbytes,))  # type: ignore[call-overload]


@dataclass
class SlotSet:
    """Two shared slots one stream of buckets alternates between. ``generation``, unique in its hub, tells a
    peer whether what it mapped is still these slots."""

    slots: list[SharedSlot]
    generation: int


class IpcHub:
    """Sender side: listens on an abstract Unix socket, where colocated receivers connect and introduce
    themselves. Owns the shared slots, two per stream, created once and grown only when a bucket no longer
    fits. A stream's ``key`` is "" for a whole version, or a class's key for each class of a sharded version,
    since the classes are sent at once."""

    def __init__(self, name: str, device: DeviceInfo) -> None:
        self.name = name
        self.device = device
        self._slot_sets: dict[str, SlotSet] = {}
        self._generations = itertools.count(1)
        self._peers: dict[str, IpcPeer] = {}
        self._changed = threading.Condition()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(abstract_address(name))
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept_loop, name="ckpt-ipc-accept", daemon=True).start()

    def ensure_slots(self, nbytes: int, key: str = "") -> list[torch.Tensor]:
        current = self._slot_sets.get(key)
        if current is None or current.slots[0].nbytes < nbytes:
            for slot in current.slots if current is not None else []:
                slot.close()
            current = self._slot_sets[key] = SlotSet([create_slot(i, max(nbytes, 1), self.device) for i in range(2)],
                                                     next(self._generations))
        return [slot.tensor for slot in current.slots]

    def slot_set(self, key: str = "") -> SlotSet:
        found = self._slot_sets.get(key)
        if found is None:
            raise CkptEngineError(f"no shared slots for stream {key[:12]!r} yet")
        return found

    @property
    def slots(self) -> list[SharedSlot]:
        """The slots of whole versions; empty while there are none."""
        found = self._slot_sets.get("")
        return found.slots if found is not None else []

    def keep_slot_sets(self, keys: set[str]) -> None:
        """Free the slots of classes no longer sent; whole versions' slots stay. A deployment whose receivers
        come and go would otherwise keep two buckets of shared memory for every class it ever had."""
        for key in [k for k in self._slot_sets if k and k not in keys]:
            for slot in self._slot_sets.pop(key).slots:
                slot.close()

    def peers(self, wanted: Mapping[str, int], timeout_s: float
              ) -> tuple[list[IpcPeer], dict[str, tuple[QuorumRank, str]]]:
        """The connected peers among ``wanted`` (agent id -> quorum rank), after waiting up to ``timeout_s``
        for the rest. Also returns, for those still missing, their rank and why."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for agent_id in [a for a in wanted if a in self._peers and not self._peers[a].alive()]:
                    self._peers.pop(agent_id).channel.close()  # gone; it may be reconnecting right now
                if all(a in self._peers for a in wanted) or time.monotonic() >= deadline:
                    break
                self._changed.wait(min(0.1, max(deadline - time.monotonic(), 0.001)))
            found = [self._peers[a] for a in wanted if a in self._peers]
            for peer in found:
                peer.rank, peer.in_use = wanted[peer.agent_id], True
        missing = {a: (QuorumRank(rank), f"colocated receiver {a} did not connect within {timeout_s:.0f}s")
                   for a, rank in wanted.items() if a not in {p.agent_id for p in found}}
        return found, missing

    def release(self, peers: list[IpcPeer]) -> None:
        """End a version with these peers. Close the channels of those replaced by a reconnect meanwhile; they
        were kept open until now so that what they already sent, such as their acknowledgement, is still read.
        Slots replaced by larger ones are freed here once the receivers that mapped them have mapped the new
        ones."""
        with self._changed:
            for peer in peers:
                peer.in_use = False
                if self._peers.get(peer.agent_id) is not peer:
                    peer.channel.close()
        collect_shared(self.device)

    def forget(self, peer: IpcPeer) -> None:
        peer.channel.close()
        with self._changed:
            if self._peers.get(peer.agent_id) is peer:
                del self._peers[peer.agent_id]

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._changed:
            for peer in self._peers.values():
                peer.channel.close()
            self._peers.clear()
        for slot_set in self._slot_sets.values():
            for slot in slot_set.slots:
                slot.close()
        self._slot_sets.clear()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            channel = FramedSocket(conn)
            try:
                hello, _ = channel.recv(5.0)
                if hello.get("type") != "hello" or not isinstance(hello.get("agent_id"), str):
                    raise ProtocolError("the first IPC frame must be a hello with an agent_id")
            except CkptEngineError as exc:
                log.warning("rejected an IPC connection: %s", exc)
                channel.close()
                continue
            peer = IpcPeer(hello["agent_id"], channel, proto=_proto_of(hello))
            with self._changed:
                old = self._peers.pop(peer.agent_id, None)
                self._peers[peer.agent_id] = peer
                self._changed.notify_all()
                if old is not None and not old.in_use:  # one in use is closed by release()
                    old.channel.close()


def _proto_of(hello: dict) -> int:
    proto = hello.get("proto", 1)
    return proto if isinstance(proto, int) and not isinstance(proto, bool) else 1


@dataclass
class IpcPeer:
    agent_id: str
    channel: FramedSocket
    proto: int = 1  # the same-host protocol it said it speaks
    rank: int = 0
    mapped_generation: int = 0
    mapped_buffers: set[int] = field(default_factory=set)
    released: int = -1
    dropped: str | None = None
    in_use: bool = False  # part of the version being sent
    pending_ack: dict[str, Any] | None = field(default=None, repr=False)

    def alive(self) -> bool:
        """False once the receiver closed its end. Checked between versions, when a live receiver has nothing
        to say."""
        sock = self.channel.sock
        try:
            if not select.select([sock], [], [], 0)[0]:
                return True
            return sock.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False
