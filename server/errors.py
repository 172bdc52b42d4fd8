"""Errors the control plane maps to HTTP statuses and ZMQ error replies."""

from __future__ import annotations

from ckpt_engine.errors import CkptEngineError


class ControlError(CkptEngineError):
    status = 400
    error = "bad request"

    def __init__(self, detail: str, record: dict | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.record = record


class BadRequest(ControlError):
    pass


class NotFound(ControlError):
    status = 404
    error = "not found"


class Conflict(ControlError):
    status = 409
    error = "conflict"


class Unavailable(ControlError):
    status = 503
    error = "unavailable"


class Unauthorized(ControlError):
    status = 401
    error = "unauthorized"


class Forbidden(ControlError):
    status = 403
    error = "forbidden"


class TooManyRequests(ControlError):
    status = 429
    error = "too many requests"
