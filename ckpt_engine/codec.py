"""The one wire form of a typed message between processes: msgpack of the pydantic model's JSON-mode dump.

Every hop uses it: the data plane's headers, trailers, acks and aborts; rank 0's assignment to the other trainer
ranks; verl's actor rank 0 announcing a sync to the others. Never pickle: a peer's bytes are parsed, not run.
"""

from __future__ import annotations

from typing import TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from ckpt_engine.errors import ProtocolError

# One message between processes, at most (a layout of ~100k tensors fits).
MAX_MESSAGE_BYTES = 64 << 20

M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """The message's bytes; ProtocolError when they would exceed what a peer accepts."""
    raw = msgpack.packb(message.model_dump(mode="json"), use_bin_type=True)
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{type(message).__name__} of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return raw


def decode(kind: type[M], raw: bytes) -> M:
    """Parse a message; anything malformed, truncated or oversized is a ProtocolError (its text bounded: what
    failed and where, never the peer's bytes)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{kind.__name__} of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable {kind.__name__}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{kind.__name__} must be a map, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(map(str, first["loc"]))[:200]
        raise ProtocolError(f"invalid {kind.__name__}: {where}: {first['msg'][:200]}") from None
