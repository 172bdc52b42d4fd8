"""A version streamed into a load (staging ``stream``): the load iterates ``payload.items()``, and each step
receives and verifies what it yields; bucket k+1 is on the wire while bucket k is applied, so two bucket
buffers are in use (plus what the load itself keeps views of, and a chunked tensor being put together)
whatever the model's size.

The promise stays that of a whole version: no byte of a bucket reaches the load before that bucket verified,
the stream ends only after the last bucket and the trailer verified (the load finishes, and its engine
resumes, only then), and a failure part way raises into the load, which then holds no whole version: it is
reported torn (nothing was applied yet: refused) and repaired from the trainer's cache like any torn apply.
Whatever the load does, the rest of the version is still taken off the wire so the sender and the other
receivers go on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ckpt_engine.errors import ProtocolError
from ckpt_engine.plan.dtypes import dtype_from_name
from ckpt_engine.plan.layout import Bucket, Layout, TensorSlot
from ckpt_engine.plan.sparse import Manifest
from ckpt_engine.plan.tensors import slot_view
from ckpt_engine.receive.assembly import Feed, Incoming, VersionAssembler
from ckpt_engine.receive.payload import ReceiveResult, SenderAborted, StreamFailed, VersionPayload

log = logging.getLogger(__name__)


@dataclass
class _Progress:
    yielded: int = 0  # tensors handed to the load
    trailer_read: bool = False
    wire_error: BaseException | None = None  # the transport failed: nothing more can be read of this version
    manifest: Manifest | None = None  # set once the whole version verified


def receive_streamed(assembler: VersionAssembler, incoming: Incoming, feed: Feed,
                     desynced: Callable[[BaseException], str]) -> ReceiveResult:
    """Stream ``incoming`` into the assembler's load; ``desynced(exc)`` turns a transport failure into the
    reason (and marks the transport broken)."""
    header, result = incoming.header, incoming.result
    flow = assembler.flow(incoming, feed)
    progress = _Progress()
    refusal = assembler.base_problem(header)
    if refusal is None:
        stream = _Guarded(_tensors(assembler, incoming, flow, feed, progress))
        payload = VersionPayload(header.version, header.step, header.mode, None, {},
                                 sparse=header.base_version is not None, specs=assembler.specs(incoming),
                                 stream=stream, aliases=dict(header.aliases))
        failure = assembler.call_load(incoming, payload, touched=lambda: progress.yielded > 0)
        stream.close(f"version {header.version}: the receiver stopped waiting for its load")
        if failure is None and progress.manifest is None:
            result.reason = "the load returned before the end of the streamed version"
            failure = StreamFailed(result.reason)
            if progress.yielded:
                result.torn = True
                assembler.manifest, assembler.committed = None, None
    else:
        failure = StreamFailed(refusal)
        result.reason = refusal
    error = progress.wire_error
    if error is not None:  # nothing more of the version can be read: an abort, or the transport failed
        if isinstance(error, SenderAborted):
            feed.follow_the_rest(incoming.layout)  # (the lead's: the other owners still send theirs)
        reason = str(error) if isinstance(error, SenderAborted) else desynced(error)
        return assembler.finish(incoming, f"{reason}{' (the model is torn)' if result.torn else ''}")
    if not progress.trailer_read:
        problem = _drain(flow, feed, incoming.layout)
        if problem is not None:
            return assembler.finish(incoming, f"{result.reason}; and the rest of the version: {desynced(problem)}")
    if failure is None and progress.manifest is not None:
        assembler.manifest = progress.manifest
        assembler.loaded(incoming, progress.manifest.version_digest)
        result.version_digest = progress.manifest.version_digest
    return assembler.finish(incoming)


class _Guarded:
    """The stream as the load sees it: once the receiver stopped waiting for the load (it returned, raised, or
    a driven engine's apply timed out on another thread), reading on raises instead of racing the drain."""

    def __init__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._tensors, self._lock = tensors, threading.Lock()
        self._closed: str | None = None

    def __iter__(self) -> _Guarded:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        with self._lock:
            if self._closed is not None:
                raise StreamFailed(self._closed)
            return next(self._tensors)

    def close(self, reason: str) -> None:
        with self._lock:  # (waits for a read in progress: each is bounded by the transport's timeouts)
            self._closed = reason


def _tensors(assembler: VersionAssembler, incoming: Incoming, flow: Iterator[Bucket], feed: Feed,
             progress: _Progress) -> Iterator[tuple[str, torch.Tensor]]:
    aliases: dict[str, list[str]] = {}
    for alias, canonical in incoming.header.aliases.items():
        aliases.setdefault(canonical, []).append(alias)
    version = incoming.header.version
    while True:
        try:
            bucket = next(flow, None)
        except Exception as exc:
            progress.wire_error = exc
            raise
        if incoming.bad:
            raise StreamFailed(f"version {version}: digest mismatch in {', '.join(incoming.bad[:8])} (bucket "
                               f"{bucket.index if bucket else 'last'}): nothing more of it is applied")
        if incoming.missing:
            raise StreamFailed(f"version {version}: bucket(s) {incoming.missing[:8]} never came (their owner "
                               "aborted): nothing more of it is applied")
        if bucket is None:
            break

        def prefetch(bucket: Bucket = bucket) -> None:
            assembler.start_next(incoming, feed, upto=bucket.index + 1)

        for name, tensor in _bucket_tensors(assembler, incoming, bucket, prefetch):
            progress.yielded += 1
            yield name, tensor
            # the load took this bucket's first tensor, so it let go of the bucket before: the next one goes on
            # the wire now, while this one is applied (two bucket buffers in use)
            assembler.start_next(incoming, feed, upto=bucket.index + 1)
            for alias in aliases.get(name, ()):
                yield alias, tensor
        name = tensor = None  # type: ignore[assignment]  # (nothing of this bucket is held while the next lands)
    try:
        trailer = feed.trailer()
    except Exception as exc:
        progress.wire_error = exc
        raise
    progress.trailer_read = True
    manifest, problem = assembler.judge(incoming, trailer)
    if manifest is None:
        raise StreamFailed(f"version {version}: {problem}")
    progress.manifest = manifest


def _bucket_tensors(assembler: VersionAssembler, incoming: Incoming, bucket: Bucket,
                    prefetch: Callable[[], None]) -> Iterator[tuple[str, torch.Tensor]]:
    """The verified tensors of ``bucket``; a chunked tensor once its last piece is in (its pieces are copied
    into the assembly buffer as they come, unless the sender's buffer on this host holds them back to back).
    A piece that fills its bucket lets go of the bucket once copied and puts the next one on the wire
    (``prefetch``): the load holds a tensor of an earlier bucket meanwhile, and gets none from this one."""
    buffer = assembler.bucket_buffer(incoming, bucket)
    for slot in bucket.slots:
        if not slot.is_piece:
            yield slot.name, slot_view(buffer, slot)
            continue
        if incoming.shared is not None:
            if slot.part == slot.parts - 1:
                start = incoming.layout.buckets[bucket.index - slot.part].flat_offset
                yield slot.name, _typed(incoming.shared[start : start + slot.spec.nbytes], slot)
            continue
        if slot.part == 0:
            incoming.assembly = assembler.buffers.landing(slot.spec.nbytes)
        assembly = incoming.assembly
        if assembly is None or assembly.numel() < slot.spec.nbytes:
            raise ProtocolError(f"piece {slot.part} of {slot.name!r} came without its first")
        assembly[slot.start : slot.start + slot.nbytes].copy_(buffer[slot.offset : slot.offset + slot.nbytes])
        if slot.part < slot.parts - 1:  # (a piece that is not the last fills the rest of its bucket)
            buffer = None  # type: ignore[assignment]
            incoming.landing.pop(bucket.index, None)
            prefetch()
        else:
            incoming.assembly = None  # (the load's view keeps it while it needs it)
            yield slot.name, _typed(assembly[: slot.spec.nbytes], slot)


def _typed(raw: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return raw.view(dtype_from_name(slot.dtype)).view(slot.shape)


def _drain(flow: Iterator[Bucket], feed: Feed, layout: Layout) -> BaseException | None:
    """Take the rest of the version off the wire (nothing of it is applied); the transport's failure, if any."""
    try:
        for _ in flow:
            pass
        feed.trailer()
    except Exception as exc:  # noqa: BLE001 - an abort ends it too: nothing more comes
        if isinstance(exc, SenderAborted):
            feed.follow_the_rest(layout)  # (the lead's: the other owners still send theirs)
            return None
        return exc
    return None
