"""Every operation of the daemon, once: what it takes, which roles may call it, and what it does. The ZMQ
server dispatches a message's ``type`` here; the HTTP routes call the same entries, so both control planes
check the same roles, parse the same models and give the same answers. (How a caller waits for a version
to end differs by plane: ZMQ parks the reply, HTTP waits asynchronously.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpt_engine.server.controller import Controller
from ckpt_engine.server.errors import NotFound

from ckpt_engine.control.auth import ANY_ROLE, Role
from ckpt_engine.control.messages import (FrameworkSyncRequest, LatestQuery, Poll, PollReply, Register, Report,
                                          Unregister, VersionRef, VersionsQuery, parse_body)

AGENTS: frozenset[Role] = frozenset({"trainer", "rollout"})
Handler = Callable[[Controller, dict[str, Any], set[Role]], Any]


@dataclass(frozen=True)
class Operation:
    name: str
    roles: Callable[[dict[str, Any]], frozenset[Role]]  # who may call it, given its body
    run: Handler


def _register(controller: Controller, body: dict, roles: set[Role]) -> dict:
    return controller.register(parse_body(Register, body)).model_dump()


def _poll(controller: Controller, body: dict, roles: set[Role]) -> Poll:
    """Acknowledges what the previous reply carried; the assignment (or none) is the plane's to answer."""
    poll = parse_body(Poll, body)
    controller.acknowledge(poll, roles)  # first: an acknowledged assignment must not be sent again
    return poll


def _report(controller: Controller, body: dict, roles: set[Role]) -> dict:
    controller.report(parse_body(Report, body), roles)
    return {}


def _unregister(controller: Controller, body: dict, roles: set[Role]) -> dict:
    leaving = parse_body(Unregister, body)
    controller.unregister(leaving.agent_id, leaving.session, roles)
    return {}


def _sync(controller: Controller, body: dict, roles: set[Role]) -> dict:
    request = parse_body(FrameworkSyncRequest, body)  # (over HTTP the route's SyncRequest refused receivers)
    if request.receivers is not None:  # a framework's own sync, opened by its trainer rank 0
        return controller.framework_sync(request, roles)
    return controller.request_sync(step=request.step, bypass_cpu=request.bypass_cpu, sparse=request.sparse).to_dict()


def _versions(controller: Controller, body: dict, roles: set[Role]) -> dict:
    query = parse_body(VersionsQuery, body, strict=True)
    rows = controller.history.list(limit=query.limit, status=query.status, before=query.before)
    return {"versions": [r.to_dict() for r in rows], "next_before": rows[-1].id if len(rows) == query.limit else None}


def _version(controller: Controller, body: dict, roles: set[Role]) -> dict:
    version = parse_body(VersionRef, body, strict=True).version
    record = controller.history.get(version)
    if record is None:
        raise NotFound(f"version {version} is unknown")
    return record.to_dict()


def _latest(controller: Controller, body: dict, roles: set[Role]) -> dict:
    record = controller.history.latest(status=parse_body(LatestQuery, body, strict=True).status)
    if record is None:
        raise NotFound("no versions yet")
    return record.to_dict()


def _push(controller: Controller, body: dict, roles: set[Role]) -> dict:
    return controller.push(parse_body(VersionRef, body, strict=True).version).to_dict()


def _evict(controller: Controller, body: dict, roles: set[Role]) -> dict:
    """Asks the trainer to evict; the HTTP route then waits for its confirmation."""
    return controller.request_evict(parse_body(VersionRef, body, strict=True).version).to_dict()


def _status(controller: Controller, body: dict, roles: set[Role]) -> dict:
    return controller.status()


def _receivers(controller: Controller, body: dict, roles: set[Role]) -> dict:
    return {"agents": controller.agents_public()}


def _fixed(*roles: Role) -> Callable[[dict[str, Any]], frozenset[Role]]:
    allowed = frozenset(roles) if roles else ANY_ROLE
    return lambda body: allowed


def _registering(body: dict[str, Any]) -> frozenset[Role]:
    return frozenset({"trainer"} if body.get("role") == "trainer" else {"rollout"})


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("register", _registering, _register),
    Operation("poll", _fixed("trainer", "rollout"), _poll),
    Operation("report", _fixed("trainer", "rollout"), _report),
    Operation("unregister", _fixed("trainer", "rollout"), _unregister),
    Operation("sync", _fixed("operator", "trainer"), _sync),  # trainers ask from their loop (agent.push)
    Operation("push", _fixed("operator"), _push),
    Operation("evict", _fixed("operator"), _evict),
    Operation("versions", _fixed(), _versions),
    Operation("version", _fixed(), _version),
    Operation("latest", _fixed(), _latest),
    Operation("status", _fixed(), _status),
    Operation("receivers", _fixed(), _receivers),
)}


__all__ = ["AGENTS", "OPERATIONS", "Operation", "PollReply"]
