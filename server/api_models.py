"""Request and response bodies of the HTTP API, so /openapi.json states what every status really returns
(the fuzz test, tests/test_fuzz_http.py, checks live responses against it)."""

from __future__ import annotations

from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from ckpt_engine.control import WireInt
from ckpt_engine.server.history import STATUSES, VersionRecord

Status = Literal[STATUSES]  # type: ignore[valid-type]  # the store's statuses, one list for both


# sparse works from the host cache, bypass_cpu skips it: a body asking for both gets a 400 (the controller's
# check, which also covers one of them coming from the deployment's defaults); the schema says so too.
_NOT_SPARSE_AND_BYPASS = {"not": {"required": ["sparse", "bypass_cpu"],
                                  "properties": {"sparse": {"const": True}, "bypass_cpu": {"const": True}}}}


class SyncBody(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_NOT_SPARSE_AND_BYPASS)
    step: WireInt | None = Field(None, description="trainer step this version belongs to")
    bypass_cpu: bool | None = Field(None, description="override the deployment's bypass_cpu for this version")
    sparse: bool | None = Field(None, description="send only tensors changed since the version every receiver "
                                "holds (default: the deployment's sparse)")
    wait: bool = Field(False, description="answer with the final record instead of 202 at once")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="how long to wait when wait is true")


class FieldProblem(BaseModel):
    loc: list[str | int]
    msg: str


class ErrorBody(BaseModel):
    """Every 4xx and 5xx the API itself produces."""

    error: str = Field(description="short class of the error: unauthorized, not found, conflict, ...")
    detail: str | list[FieldProblem] = Field(description="what was wrong; for 422 one entry per bad field")
    record: dict[str, Any] | None = Field(None, description="the version record concerned (503: the failed "
                                          "version; 409: {in_flight: id})")


class _Out(BaseModel):
    # Responses are validated against these models; a field added on the server side passes through
    # instead of being dropped silently.
    model_config = ConfigDict(extra="allow")


# One row of the version history: the store's own record, with its mode and status spelled out for the schema.
_SPELLED_OUT = {"mode": Literal["cached", "bypass_cpu"], "status": Status}
VersionOut = create_model(
    "VersionOut", __base__=_Out, __doc__="One row of the version history (``HistoryStore``).",
    **{name: (_SPELLED_OUT.get(name, hint), ...) for name, hint in get_type_hints(VersionRecord).items()},
)


class SyncAccepted(_Out):
    version: int
    status_url: str


class PushAccepted(SyncAccepted):
    source_version: int


class VersionList(_Out):
    versions: list[VersionOut]


class AgentOut(_Out):
    agent_id: str
    role: Literal["trainer", "receiver"]
    rank: int
    host: str
    pid: int
    device: str
    host_id: str | None
    versions: list[int]
    sync_every: int
    registered_at: float
    seconds_since_seen: float


class AgentList(_Out):
    agents: list[AgentOut]


class StatusOut(_Out):
    in_flight: int | None
    generation: int
    trainer: str | None
    receivers: int
    versions: dict[str, int]
    cache_versions: list[int]
    started_at: float
    config: dict[str, Any]
    version: str


class Health(_Out):
    ok: bool


_DESCRIPTIONS = {
    400: "Bad request: sparse combined with bypass_cpu (in the body, or one of them from the deployment)",
    401: "Missing or wrong bearer token (only when the daemon has an auth_token)",
    404: "Unknown version",
    409: "Conflict: a version is in flight, or the version is not in the trainer's cache",
    413: "Request body over http.max_body_bytes",
    422: "Invalid parameters or body",
    503: "Not enough agents registered (the refused version is recorded as failed)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error statuses, all with the ErrorBody schema."""
    return {code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]} for code in codes}
