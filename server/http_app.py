"""HTTP control plane (FastAPI). OpenAPI is at /openapi.json, drawn as a page at /docs by server/api_docs.py.
Most handlers are plain functions, which FastAPI runs in its thread pool. The two that wait on agents (``POST
/sync`` with wait, ``DELETE /versions/{version}``) call the controller in a thread and wait on the event loop,
so a waiting request holds no worker thread. Errors are JSON ``{error, detail}``; every status an operation can
answer with is declared in the OpenAPI document (server/api_models.py)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter as Tally
from collections.abc import Callable
from http import HTTPStatus
from typing import Annotated, Any
from urllib.parse import parse_qsl

import anyio.to_thread
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import Counter
from pydantic import BaseModel, BeforeValidator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckpt_engine import __version__
from ckpt_engine.config import EngineConfig
from ckpt_engine.control.auth import Role
from ckpt_engine.control.messages import MAX_ID, LatestQuery, SyncRequest, VersionRef, VersionsQuery, plain_int
from ckpt_engine.server.api_docs import DOCS_PATH, add_api_docs
from ckpt_engine.server.api_models import (
    AgentList,
    Health,
    PushAccepted,
    StatusOut,
    SyncAccepted,
    VersionList,
    VersionOut,
    error_responses,
)
from ckpt_engine.server.authority import Authority
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import ControlError, Forbidden, TooManyRequests, Unavailable
from ckpt_engine.server.history import TERMINAL, StorageUnavailable, VersionRecord
from ckpt_engine.server.operations import OPERATIONS, NoBody
from ckpt_engine.server.page_routes import PAGE_FILES, add_page

_MAX_WAITING = 64
_WAIT_POLL_S = 0.05
_EVICT_WAIT_S = 10.0
# Bounded like every id on the wire: a larger path value is a 422, not an OverflowError (500) in the store.
# Digits only: /versions/1.0 and /versions/%201 are a 422, not version 1.
VersionId = Annotated[int, Path(ge=-MAX_ID, le=MAX_ID, description="version id"), BeforeValidator(plain_int)]


def _error(status: int, error: str, detail: Any, record: dict | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": error, "detail": detail}
    if record is not None:
        body["record"] = record
    return JSONResponse(body, status_code=status, headers=headers)


def _too_large(limit: int) -> StarletteHTTPException:
    return StarletteHTTPException(413, f"request bodies are limited to {limit} bytes")


class LimitsAndAuth:
    """Pure ASGI middleware: request bodies over the limit get 413; without a valid bearer token, 401. The
    roles the token grants go to the request's state, where each operation checks the ones it needs (403)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, authority: Authority, refused: Counter | None = None) -> None:
        self.app, self.max_body_bytes, self.authority = app, max_body_bytes, authority
        self.refused = refused  # ckpt_engine_refused_total: a 401 counts as ZMQ's 'unauthorized' does

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode(errors="replace") for k, v in scope.get("headers", [])}
        roles = self.authority.roles_of(_bearer(headers))
        if not roles and not _public(scope):
            if self.refused is not None:
                self.refused.labels(reason="unauthorized").inc()
            await _error(401, "unauthorized", "send 'Authorization: Bearer <token>'",
                         headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        scope.setdefault("state", {})["roles"] = roles
        repeated = _repeated_parameters(scope.get("query_string", b""))
        if repeated:  # refused: the app would read one of them, a proxy in front perhaps another
            await _error(422, "invalid request", [{"loc": ["query", name], "msg": "given more than once"}
                                                  for name in repeated])(scope, receive, send)
            return
        declared = headers.get("content-length", "0")
        # isascii: str.isdigit() is also true for digits like '²' that int() refuses
        if not (declared.isascii() and declared.isdigit()) or int(declared) > self.max_body_bytes:
            await _error(413, "payload too large", f"request bodies are limited to {self.max_body_bytes} bytes")(
                scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            # A chunked body has no Content-Length: count it as it arrives. Raise an HTTPException: FastAPI
            # turns any other error while reading a body into a 400.
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            return message

        await self.app(scope, limited_receive, send)



def _repeated_parameters(query: bytes) -> list[str]:
    counts = Tally(name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))
    return sorted(name for name, count in counts.items() if count > 1)


def _public(scope: Scope) -> bool:
    """Paths served without a token: /health, the operator page's static files and the API reference at /docs.
    None of them holds data: the page asks for a token itself."""
    return scope["path"] == "/health" or ((scope["path"] in PAGE_FILES or scope["path"] == DOCS_PATH)
                                          and scope["method"] in ("GET", "HEAD"))


def _bearer(headers: dict[str, str]) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def create_app(controller: Controller, config: EngineConfig, authority: Authority) -> FastAPI:
    # No Swagger UI or ReDoc: they load their assets from a CDN. server/api_docs.py draws /docs instead.
    app = FastAPI(title="ckpt-engine", version=__version__, docs_url=None, redoc_url=None,
                  description="Versioned, verified weight sync from trainers to rollout engines.")
    app.add_middleware(LimitsAndAuth, max_body_bytes=config.http.max_body_bytes, authority=authority,
                       refused=controller.metrics.refused)
    # Declares the bearer scheme in the OpenAPI document; LimitsAndAuth does the checking (also for 404s).
    auth = [] if authority.open else [Depends(HTTPBearer(auto_error=False))]

    def call(name: str, request: Request, parsed: BaseModel | None = None) -> Any:
        """Run operation ``name`` (server/operations.py) on the request FastAPI parsed, as the ZMQ plane does.
        Raises Forbidden unless the token holds a role the operation allows."""
        operation = OPERATIONS[name]
        roles: set[Role] = getattr(request.state, "roles", set())
        allowed = operation.roles({})
        if not roles & allowed:
            raise Forbidden(f"{name} needs a token of role {' or '.join(sorted(allowed))}; this one is "
                            f"{', '.join(sorted(roles)) or 'none'}")
        return operation.run(controller, parsed if parsed is not None else NoBody(), roles)
    guarded = (401, 413)  # what LimitsAndAuth can answer on every operation but /health
    # Requests that wait on agents (sync with wait, evict) wait on the event loop, not in a worker thread, so
    # /health and reads never queue behind them. At most _MAX_WAITING wait at once (then 429).
    waiting = asyncio.Semaphore(_MAX_WAITING)

    @app.exception_handler(ControlError)
    def control_error(_: Request, exc: ControlError) -> JSONResponse:
        controller.metrics.refused.labels(reason=exc.error).inc()
        return _error(exc.status, exc.error, exc.detail, exc.record)

    @app.exception_handler(StorageUnavailable)
    def storage_error(_: Request, exc: StorageUnavailable) -> JSONResponse:
        return _error(503, "unavailable", str(exc))

    @app.exception_handler(RequestValidationError)
    def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
        return _error(422, "invalid request", detail)

    @app.exception_handler(StarletteHTTPException)
    def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names only the first matching route's methods
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return _error(exc.status_code, _error_name(exc.status_code), exc.detail, headers=headers)

    @app.exception_handler(Exception)
    def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, "internal error", f"{type(exc).__name__}: {exc}")

    async def wait_for(check: Callable[[], VersionRecord | None], timeout_s: float) -> VersionRecord | None:
        if waiting.locked():
            raise TooManyRequests(f"{_MAX_WAITING} requests are waiting already; retry later or do not wait")
        async with waiting:
            deadline = time.monotonic() + timeout_s
            while (found := check()) is None and time.monotonic() < deadline:
                await asyncio.sleep(_WAIT_POLL_S)
            return found

    @app.post("/sync", status_code=202, summary="Start a new version (or wait for its end with wait=true)",
              dependencies=auth, response_model=SyncAccepted, responses={
                  200: {"model": VersionOut, "description": "wait=true: the version committed"},
                  502: {"model": VersionOut, "description": "wait=true: the version failed or was cancelled"},
                  504: {"model": VersionOut, "description": "wait=true: still in flight when the wait ran out"},
                  **error_responses(*guarded, 400, 403, 409, 422, 429, 503)})
    async def sync(body: SyncRequest, request: Request) -> Any:
        if body.wait and waiting.locked():
            raise TooManyRequests(f"{_MAX_WAITING} requests are waiting already; retry later or do not wait")
        record = await anyio.to_thread.run_sync(lambda: call("sync", request, body))
        version = record["id"]
        if not body.wait:
            return JSONResponse({"version": version, "status_url": str(request.url_for("version", version=version))},
                                status_code=202)
        final = await wait_for(lambda: _ended(controller.history.get(version)),
                               body.timeout_s or config.timeouts.version_s)
        final = final or controller.history.get(version)
        return JSONResponse(final.to_dict(), status_code=200 if final.status == "committed" else  # type: ignore[union-attr]
                            (504 if final.status not in TERMINAL else 502))  # type: ignore[union-attr]

    @app.get("/versions", summary="Version history, newest first (page with before=next_before)",
             dependencies=auth, response_model=VersionList, responses=error_responses(*guarded, 422, 503))
    def versions(request: Request, query: Annotated[VersionsQuery, Query()]) -> Response:
        # Not validated against VersionList: the store's records already are what it declares, encoded.
        return Response(call("versions", request, query), media_type="application/json")

    @app.get("/versions/latest", summary="The newest version (any status)", dependencies=auth,
             response_model=VersionOut, responses=error_responses(*guarded, 404, 422, 503))
    def latest(request: Request, query: Annotated[LatestQuery, Query()]) -> dict:
        return call("latest", request, query)

    @app.delete("/versions/latest", include_in_schema=False)
    def evict_latest() -> None:
        # without this route, DELETE /versions/latest would reach DELETE /versions/{version} and get a 422
        raise StarletteHTTPException(405)

    @app.get("/versions/{version}", name="version", summary="One version's record", dependencies=auth,
             response_model=VersionOut, responses=error_responses(*guarded, 404, 422, 503))
    def version(version: VersionId, request: Request) -> dict:
        return call("version", request, VersionRef(version=version))

    @app.post("/versions/{version}/push", status_code=202, summary="Re-push a cached version (rollback)",
              dependencies=auth, response_model=PushAccepted,
              responses=error_responses(*guarded, 403, 404, 409, 422, 503))
    def push(version: VersionId, request: Request) -> JSONResponse:
        record = call("push", request, VersionRef(version=version))
        return JSONResponse({"version": record["id"], "source_version": version,
                             "status_url": str(request.url_for("version", version=record["id"]))}, status_code=202)

    @app.delete("/versions/{version}", summary="Evict a version from the trainer's cache (history stays)",
                dependencies=auth, response_model=VersionOut,
                responses=error_responses(*guarded, 403, 404, 409, 422, 429, 503))
    async def evict(version: VersionId, request: Request) -> dict:
        if waiting.locked():
            raise TooManyRequests(f"{_MAX_WAITING} requests are waiting already; retry later")
        await anyio.to_thread.run_sync(lambda: call("evict", request, VersionRef(version=version)))
        record = await wait_for(lambda: _uncached(controller.history.get(version)), _EVICT_WAIT_S)
        if record is None:
            raise Unavailable(f"the trainer did not confirm eviction of version {version} in {_EVICT_WAIT_S:.0f}s")
        return record.to_dict()

    @app.get("/receivers", summary="Registered agents and what each receiver's model holds", dependencies=auth,
             response_model=AgentList, responses=error_responses(*guarded))
    def receivers(request: Request) -> dict:
        return call("receivers", request)

    @app.get("/status", summary="Config summary, in-flight version, cache, storage", dependencies=auth,
             response_model=StatusOut, responses=error_responses(*guarded, 503))
    def status(request: Request) -> dict:
        return {**call("status", request), "config": {
            "bypass_cpu": config.bypass_cpu, "bucket_size_mb": config.bucket_size_mb, "device": config.device,
            "backend": config.backend, "keep_versions": config.keep_versions, "verify": config.verify,
            "min_receivers": config.min_receivers, "transport": config.transport, "zmq": config.zmq.endpoint,
            "auth": not authority.open,
        }, "version": __version__}

    @app.get("/health", summary="Liveness (no token needed): 503 while the controller's periodic work keeps "
             "failing; degraded while the history cannot be written", response_model=Health,
             responses={503: {"model": Health, "description": "the controller's periodic work keeps failing"},
                        **error_responses(413)})
    async def health() -> Any:
        problem = controller.tick_health.problem(controller.clock())
        body = {"ok": problem is None, "degraded": controller.history.degraded, "problem": problem}
        return body if problem is None else JSONResponse(body, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", dependencies=auth, response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}, **error_responses(*guarded)})
    def metrics() -> Response:
        return Response(controller.metrics.render(), media_type="text/plain; version=0.0.4")

    add_page(app)
    add_api_docs(app)
    return app


def _ended(record: VersionRecord | None) -> VersionRecord | None:
    """The record once its version has ended (committed, failed, ...), else None."""
    return record if record is not None and record.status in TERMINAL else None


def _uncached(record: VersionRecord | None) -> VersionRecord | None:
    """The record once the trainer no longer caches its version, else None."""
    return record if record is not None and not record.cached else None


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Methods of the documented operations whose path matches the request's (for Allow on a 405)."""
    matched = [route for route in app.routes if isinstance(route, APIRoute) and route.include_in_schema
               and route.matches(scope)[0] != Match.NONE]
    literal = [route for route in matched if not route.param_convertors]  # /versions/latest, not /versions/{version}
    return sorted({method for route in (literal or matched) for method in route.methods or ()})


def _error_name(status: int) -> str:
    if status == 413:
        return "payload too large"
    try:
        return HTTPStatus(status).phrase.lower()
    except ValueError:
        return "http error"
