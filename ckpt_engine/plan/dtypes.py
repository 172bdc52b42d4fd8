"""Dtype names on the wire. Only dtypes in this table are accepted from peers (no getattr on input)."""

from __future__ import annotations

import torch

from ckpt_engine.errors import ProtocolError

_CANDIDATES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
)

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, e.g. ``torch.bfloat16`` -> ``"bfloat16"``."""
    try:
        return NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype} is not supported on the wire") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Torch dtype of a wire name; unknown names are a ProtocolError."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype name {name!r} on the wire") from None


def itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize
