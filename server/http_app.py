"""HTTP control plane (FastAPI; OpenAPI at /docs). Handlers are plain functions, so FastAPI runs them in its
thread pool and a waiting ``POST /sync`` never blocks the event loop. Errors are JSON ``{error, detail}``."""

from __future__ import annotations

import hmac
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ckpt_engine import __version__
from ckpt_engine.config import EngineConfig
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import ControlError, NotFound
from ckpt_engine.server.history import STATUSES, TERMINAL

Status = Literal[STATUSES]  # type: ignore[valid-type]  # the store's statuses, one list for both


class SyncBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(None, description="trainer step this version belongs to")
    bypass_cpu: bool | None = Field(None, description="override the deployment's bypass_cpu for this version")
    sparse: bool | None = Field(None, description="send only tensors changed since the version every receiver "
                                "holds (default: the deployment's sparse)")
    wait: bool = Field(False, description="answer with the final record instead of 202 at once")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="how long to wait when wait is true")


def _error(status: int, error: str, detail: Any, record: dict | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": error, "detail": detail}
    if record is not None:
        body["record"] = record
    return JSONResponse(body, status_code=status)


class LimitsAndAuth:
    """Pure ASGI middleware: request bodies over the limit get 413; without the bearer token, 401."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, token: str | None) -> None:
        self.app, self.max_body_bytes, self.token = app, max_body_bytes, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope.get("headers", [])}
        if self.token is not None and scope["path"] != "/health" and not self._authorized(headers):
            await _error(401, "unauthorized", "send 'Authorization: Bearer <token>'")(scope, receive, send)
            return
        declared = headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await _error(413, "payload too large", f"request bodies are limited to {self.max_body_bytes} bytes")(
                scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await _error(413, "payload too large", f"request bodies are limited to {self.max_body_bytes} bytes")(
                scope, receive, send)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, value = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())  # type: ignore[union-attr]


class _TooLarge(Exception):
    pass


def create_app(controller: Controller, config: EngineConfig) -> FastAPI:
    app = FastAPI(title="ckpt-engine", version=__version__,
                  description="Versioned, verified weight sync from trainers to rollout engines.")
    app.add_middleware(LimitsAndAuth, max_body_bytes=config.http.max_body_bytes, token=config.auth_token)

    @app.exception_handler(ControlError)
    def control_error(_: Request, exc: ControlError) -> JSONResponse:
        return _error(exc.status, exc.error, exc.detail, exc.record)

    @app.exception_handler(RequestValidationError)
    def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
        return _error(422, "invalid request", detail)

    @app.exception_handler(StarletteHTTPException)
    def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http error", exc.detail)

    @app.exception_handler(Exception)
    def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, "internal error", f"{type(exc).__name__}: {exc}")

    @app.post("/sync", status_code=202, summary="Start a new version (or wait for its end with wait=true)")
    def sync(body: SyncBody, request: Request) -> Any:
        record = controller.request_sync(step=body.step, bypass_cpu=body.bypass_cpu, sparse=body.sparse)
        if not body.wait:
            return JSONResponse({"version": record.id, "status_url": str(request.url_for("version", version=record.id))},
                                status_code=202)
        final = controller.wait(record.id, body.timeout_s or config.timeouts.version_s)
        return JSONResponse(final.to_dict(), status_code=200 if final.status == "committed" else
                            (504 if final.status not in TERMINAL else 502))

    @app.get("/versions", summary="Version history, newest first")
    def versions(limit: int = Query(50, ge=1, le=1000), status: Status | None = None) -> dict:
        return {"versions": [r.to_dict() for r in controller.history.list(limit=limit, status=status)]}

    @app.get("/versions/latest", summary="The newest version (any status)")
    def latest(status: Status | None = None) -> dict:
        record = controller.history.latest(status=status)
        if record is None:
            raise NotFound("no versions yet")
        return record.to_dict()

    @app.get("/versions/{version}", name="version", summary="One version's record")
    def version(version: int) -> dict:
        record = controller.history.get(version)
        if record is None:
            raise NotFound(f"version {version} is unknown")
        return record.to_dict()

    @app.post("/versions/{version}/push", status_code=202, summary="Re-push a cached version (rollback)")
    def push(version: int, request: Request) -> JSONResponse:
        record = controller.push(version)
        return JSONResponse({"version": record.id, "source_version": version,
                             "status_url": str(request.url_for("version", version=record.id))}, status_code=202)

    @app.delete("/versions/{version}", summary="Evict a version from the trainer's cache (history stays)")
    def evict(version: int) -> dict:
        return controller.evict(version).to_dict()

    @app.get("/receivers", summary="Registered agents")
    def receivers() -> dict:
        return {"agents": controller.agents_public()}

    @app.get("/status", summary="Config summary, in-flight version, cache")
    def status() -> dict:
        return {**controller.status(), "config": {
            "bypass_cpu": config.bypass_cpu, "bucket_size_mb": config.bucket_size_mb, "device": config.device,
            "backend": config.backend, "keep_versions": config.keep_versions, "verify": config.verify,
            "min_receivers": config.min_receivers, "transport": config.transport, "zmq": config.zmq.endpoint, "auth": config.auth_token is not None,
        }, "version": __version__}

    @app.get("/health", summary="Liveness (no token needed)")
    def health() -> dict:
        return {"ok": True}

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(controller.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
