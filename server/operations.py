"""Every operation of the daemon, once: the model of its request, which roles may call it, and what it does.
Each plane parses a request into that model once (the ZMQ server from a frame, strictly: a typed frame's
"1" is not a number; the HTTP routes through FastAPI from a body, strictly too, or a query or path, whose
integers are digits only) and hands the parsed request to ``run``, which hands it on to the controller: no
dump and re-parse on the way. Both planes check the same roles and give the same answers. (How a caller
waits for a version to end differs by plane: ZMQ parks the reply, HTTP waits asynchronously.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ckpt_engine.control.auth import ANY_ROLE, Role
from ckpt_engine.control.messages import (
    FrameworkSyncRequest,
    LatestQuery,
    Poll,
    PollReply,
    Register,
    Report,
    SyncRequest,
    Unregister,
    VersionRef,
    VersionsQuery,
    parse_body,
)
from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import BadRequest, NotFound
from ckpt_engine.server.receivers_view import receivers_public

AGENTS: frozenset[Role] = frozenset({"trainer", "rollout"})


class NoBody(BaseModel):
    """Operations that take nothing (a body's keys are ignored)."""


@dataclass(frozen=True)
class Operation:
    name: str
    model: type[BaseModel]  # what the request is parsed into
    roles: Callable[[dict[str, Any]], frozenset[Role]]  # who may call it, given its raw body (before parsing)
    run: Callable[[Controller, Any, set[Role]], Any]  # (the controller, the parsed request, the caller's roles)
    # A frame's values are typed (msgpack or JSON): "1" is no number and 1 no bool (as in POST /sync's body,
    # whose model is strict itself; False only for a model whose HTTP twin is a query string)
    strict: bool = True

    def parse(self, body: dict[str, Any]) -> Any:
        return parse_body(self.model, body, strict=self.strict)


def _register(controller: Controller, message: Register, roles: set[Role]) -> dict:
    return controller.register(message).model_dump()


def _poll(controller: Controller, poll: Poll, roles: set[Role]) -> Poll:
    """Acknowledges what the previous reply carried; the assignment (or none) is the plane's to answer."""
    controller.acknowledge(poll, roles)  # first: an acknowledged assignment must not be sent again
    return poll


def _report(controller: Controller, message: Report, roles: set[Role]) -> dict:
    return {"taken": controller.report(message, roles)}


def _unregister(controller: Controller, leaving: Unregister, roles: set[Role]) -> dict:
    controller.unregister(leaving.agent_id, leaving.session, roles)
    return {}


_FRAMEWORK_ONLY = frozenset(FrameworkSyncRequest.model_fields) - frozenset(SyncRequest.model_fields) - {"receivers"}


def _sync(controller: Controller, request: SyncRequest, roles: set[Role]) -> dict:
    if isinstance(request, FrameworkSyncRequest) and request.receivers is not None:
        return controller.framework_sync(request, roles)  # a framework's own sync, opened by its trainer rank 0
    stray = sorted(_FRAMEWORK_ONLY & request.model_fields_set)
    if stray:  # what HTTP refuses as unknown keys, refused here too, with the reason
        raise BadRequest(f"{', '.join(stray)}: only a framework's own sync (one naming its 'receivers') takes these")
    return controller.request_sync(request).to_dict()


class JsonText(str):
    """An answer already encoded as JSON: HTTP sends it as it is, ZMQ decodes it into the map it sends."""


def _versions(controller: Controller, query: VersionsQuery, roles: set[Role]) -> JsonText:
    rows = controller.history.list_json(limit=query.limit, status=query.status, before=query.before)
    after = rows[-1][0] if len(rows) == query.limit else None
    return JsonText(f'{{"versions":[{",".join(text for _, text in rows)}],"next_before":{json.dumps(after)}}}')


def _version(controller: Controller, ref: VersionRef, roles: set[Role]) -> dict:
    record = controller.history.get(ref.version)
    if record is None:
        raise NotFound(f"version {ref.version} is unknown")
    return record.to_dict()


def _latest(controller: Controller, query: LatestQuery, roles: set[Role]) -> dict:
    record = controller.history.latest(status=query.status)
    if record is None:
        raise NotFound("no versions yet")
    return record.to_dict()


def _push(controller: Controller, ref: VersionRef, roles: set[Role]) -> dict:
    return controller.push(ref.version).to_dict()


def _evict(controller: Controller, ref: VersionRef, roles: set[Role]) -> dict:
    """Asks the trainer to evict; the HTTP route then waits for its confirmation."""
    return controller.request_evict(ref.version).to_dict()


def _status(controller: Controller, _: NoBody, roles: set[Role]) -> dict:
    return controller.status()


def _receivers(controller: Controller, _: NoBody, roles: set[Role]) -> dict:
    return {"agents": receivers_public(controller)}


def _fixed(*roles: Role) -> Callable[[dict[str, Any]], frozenset[Role]]:
    allowed = frozenset(roles) if roles else ANY_ROLE
    return lambda body: allowed


def _registering(body: dict[str, Any]) -> frozenset[Role]:
    return frozenset({"trainer"} if body.get("role") == "trainer" else {"rollout"})


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("register", Register, _registering, _register),
    Operation("poll", Poll, _fixed("trainer", "rollout"), _poll),
    Operation("report", Report, _fixed("trainer", "rollout"), _report),
    Operation("unregister", Unregister, _fixed("trainer", "rollout"), _unregister),
    # trainers ask from their loop (agent.push); a frame may name a framework's receivers (HTTP's SyncRequest
    # refuses them as an unknown key)
    Operation("sync", FrameworkSyncRequest, _fixed("operator", "trainer"), _sync),
    Operation("push", VersionRef, _fixed("operator"), _push),
    Operation("evict", VersionRef, _fixed("operator"), _evict),
    Operation("versions", VersionsQuery, _fixed(), _versions),
    Operation("version", VersionRef, _fixed(), _version),
    Operation("latest", LatestQuery, _fixed(), _latest),
    Operation("status", NoBody, _fixed(), _status),
    Operation("receivers", NoBody, _fixed(), _receivers),
)}


__all__ = ["AGENTS", "OPERATIONS", "JsonText", "NoBody", "Operation", "PollReply"]
